"""The spine every source shares: keyed permutation, sample plan, rank sampler, plan loader,
``PlanDataModule`` and data-parallel rank resolution."""
