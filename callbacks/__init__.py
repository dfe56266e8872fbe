"""Lightning callbacks that steer training data: phase schedules for mixtures and learning rate."""
