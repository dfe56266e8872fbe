"""Lightning DataModules for language and vision-language model training.

Every source is served through one global sample plan (``datamodules.plan``): deterministic order,
exact O(1) resume. Source families live in subpackages (``datamodules.text``, ...); their public
names are exported here and imported on first use, so a command such as ``prepare`` starts without
loading torch and Lightning.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ConversationDataModule": "datamodules.chat.conversation_datamodule",
    "ConversationSource": "datamodules.chat.conversation_source",
    "EpochProgressBar": "datamodules.callbacks.epoch_progress_bar",
    "GenerationServer": "datamodules.speculative.generation_client",
    "HFTextDataModule": "datamodules.text.hf_text",
    "HFTextSource": "datamodules.text.hf_text",
    "HiddenStatesDataModule": "datamodules.speculative.hidden_states_datamodule",
    "ImageTextDataModule": "datamodules.vision.image_text_datamodule",
    "ImageTextSource": "datamodules.vision.image_text_source",
    "MixtureComponent": "datamodules.mixture",
    "MixtureDataModule": "datamodules.mixture",
    "MultipackBatchSampler": "datamodules.plan.multipack",
    "PhaseScheduler": "datamodules.callbacks.phase_scheduler",
    "PlanDataModule": "datamodules.plan.datamodule",
    "PlannedSource": "datamodules.plan.sample_plan",
    "ProgressLines": "datamodules.callbacks.progress_lines",
    "SamplePlan": "datamodules.plan.sample_plan",
    "TokenShardDataModule": "datamodules.text.token_shard_datamodule",
    "TokenShardSource": "datamodules.text.token_shard_source",
    "TokenShards": "datamodules.text.token_shards",
    "VideoDataModule": "datamodules.vision.video_datamodule",
    "VideoSource": "datamodules.vision.video_source",
    "WeightedSource": "datamodules.mixture",
}

__all__ = [
    "ConversationDataModule",
    "ConversationSource",
    "EpochProgressBar",
    "GenerationServer",
    "HFTextDataModule",
    "HFTextSource",
    "HiddenStatesDataModule",
    "ImageTextDataModule",
    "ImageTextSource",
    "MixtureComponent",
    "MixtureDataModule",
    "MultipackBatchSampler",
    "PhaseScheduler",
    "PlanDataModule",
    "PlannedSource",
    "ProgressLines",
    "SamplePlan",
    "TokenShardDataModule",
    "TokenShardSource",
    "TokenShards",
    "VideoDataModule",
    "VideoSource",
    "WeightedSource",
]

if TYPE_CHECKING:
    from datamodules.callbacks.epoch_progress_bar import EpochProgressBar
    from datamodules.callbacks.phase_scheduler import PhaseScheduler
    from datamodules.callbacks.progress_lines import ProgressLines
    from datamodules.chat.conversation_datamodule import ConversationDataModule
    from datamodules.chat.conversation_source import ConversationSource
    from datamodules.mixture import MixtureComponent, MixtureDataModule, WeightedSource
    from datamodules.plan.datamodule import PlanDataModule
    from datamodules.plan.multipack import MultipackBatchSampler
    from datamodules.plan.sample_plan import PlannedSource, SamplePlan
    from datamodules.speculative.generation_client import GenerationServer
    from datamodules.speculative.hidden_states_datamodule import HiddenStatesDataModule
    from datamodules.text.hf_text import HFTextDataModule, HFTextSource
    from datamodules.text.token_shard_datamodule import TokenShardDataModule
    from datamodules.text.token_shard_source import TokenShardSource
    from datamodules.text.token_shards import TokenShards
    from datamodules.vision.image_text_datamodule import ImageTextDataModule
    from datamodules.vision.image_text_source import ImageTextSource
    from datamodules.vision.video_datamodule import VideoDataModule
    from datamodules.vision.video_source import VideoSource


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'datamodules' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
