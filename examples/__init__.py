"""Reference models and the quickstart job that the configs and tests train."""
