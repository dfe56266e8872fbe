"""Lightning DataModules for language and vision-language model training.

Every source is served through one global sample plan: deterministic order, exact O(1) resume.
"""

from datamodules.mixture_datamodule import MixtureComponent, MixtureDataModule
from datamodules.plan_datamodule import PlanDataModule
from datamodules.sample_plan import PlannedSource, SamplePlan
from datamodules.token_shard_datamodule import TokenShardDataModule
from datamodules.token_shard_source import TokenShardSource
from datamodules.token_shards import TokenShards

__all__ = [
    "MixtureComponent",
    "MixtureDataModule",
    "PlanDataModule",
    "PlannedSource",
    "SamplePlan",
    "TokenShardDataModule",
    "TokenShardSource",
    "TokenShards",
]
