"""``VideoSource``: clips with captions in one of the registered layouts, as a configured source
(mixable by weight), split into training and validation samples."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from datamodules.plan.arguments import check_held_out, require_existing, require_int
from datamodules.plan.bad_samples import check_policy
from datamodules.plan.held_out import HELD_OUT_NAMES, RowSplit, held_out_rows
from datamodules.plan.hf_loading import load_pretrained
from datamodules.plan.loader import SourceSpec
from datamodules.plan.parallelism import Job
from datamodules.storage.remote_files import RemoteFiles
from datamodules.vision.frame_sampling import frame_sampler
from datamodules.vision.images import CLIP_MEAN, CLIP_STD, RESIZE_MODES, ImagePixels
from datamodules.vision.prompt_labels import PromptAnswerLabels, placeholder_token_id
from datamodules.vision.video_decoding import FRAME_ACCURACIES
from datamodules.vision.video_layouts import video_layout
from datamodules.vision.video_samples import BROKEN_CLIP_POLICIES, VideoSamples


@dataclass
class VideoSource(SourceSpec):
    """Video clips and their captions (or prompts and answers).

    Args:
        data_root: the folder clip paths are relative to; a manifest path that leaves it (absolute,
            or with ``..``) is an error at setup.
        tokenizer: a ``transformers`` tokenizer name or path.
        dataset_type: the layout (``VIDEO_LAYOUTS``): ``"webvid"`` (CSV partitions with
            ``videoid``, ``name``, optional ``duration``), ``"folder"`` (clips plus a captions
            JSONL), ``"hf"`` (a HuggingFace dataset with a path column and a text column),
            ``"webdataset"`` (tar shards of clips and captions, read by member).
        manifest: the layout's manifest: CSV file(s), the captions JSONL (default
            ``captions.jsonl``), the HuggingFace dataset, or the tar shards (a brace pattern, a glob
            or a list; default ``*.tar``); relative to ``data_root`` unless absolute.
        val_manifest: a validation manifest of the same kind (for ``"hf"``: a split name); or
        val_fraction: hold out this fraction of the clips, chosen by a fixed keyed shuffle.
        test_manifest, test_fraction: the same for the test split (``Trainer.test``).
        layout_options: the layout's own settings (e.g. ``{"id_prefix_len": 3}`` for WebVid,
            ``{"video_field": "path"}`` for ``"hf"``).
        frame_sampling: the policy (``FRAME_SAMPLERS``): ``"uniform"`` (``fps``, ``min_frames``)
            or ``"fixed_count"`` (``num_frames``, ``random_offset``), with its ``frame_options``.
        frame_options: the policy's settings, e.g. ``{"fps": 1.0}`` or ``{"num_frames": 8,
            "random_offset": true}``.
        max_frames: the frame axis of every batch; fewer sampled frames are masked out.
        frame_accuracy: ``"exact"`` (default: each timestamp gets its nearest frame, exactly as a
            decode-everything reference), or ``"keyframe"``: its nearest keyframe, decoding only
            keyframes (several times faster where keyframes are sparse); ``timestamps`` then hold
            those keyframes' own times.
        image_size, resize_mode, mean, std: frames resized and normalized as in ``ImageTextSource``.
        num_video_tokens: placeholder positions for the clip's embeddings in the text (0: none).
        image_token: the placeholders' token (default: the pad id). add_bos: start with BOS.
        prompt: one prompt for every clip (a layout's prompt column, if given, wins).
        on_broken_clip: ``"mask"`` (default: the sample keeps its shape with no frame and no loss,
            counted and logged) or ``"raise"``.
        storage_options: for a ``data_root`` or manifest that is a URL (``s3://``, ``gs://``, ...), the
            fsspec filesystem's options (endpoint, credentials, ``anon``).
        file_cache_dir, file_cache_bytes: a node-local folder keeping clips read by URL (each by its
            URL and version: a changed object is fetched again), shared by the node's ranks and
            workers, and the most bytes it holds; default: no cache (clips read into memory).
        file_cache_policy: which clips leave the cache when it is full: ``"planned"`` (default), the
            one the node's ranks read furthest ahead in the plan (a clip read later than all of those is
            not kept: Belady's rule); ``"lru"``, the least recently used.
    """

    data_root: str
    tokenizer: str
    dataset_type: str = "folder"
    manifest: str | list[str] | None = None
    val_manifest: str | list[str] | None = None
    val_fraction: float = 0.0
    layout_options: dict[str, Any] = field(default_factory=dict)
    frame_sampling: str = "uniform"
    frame_options: dict[str, Any] = field(default_factory=dict)
    max_frames: int = 8
    frame_accuracy: str = "exact"
    image_size: int = 224
    resize_mode: str = "crop"
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    num_video_tokens: int = 0
    image_token: str | None = None
    add_bos: bool = False
    prompt: str = ""
    on_broken_clip: str = "mask"
    storage_options: dict[str, Any] | None = None
    file_cache_dir: str | None = None
    file_cache_bytes: int | None = None
    file_cache_policy: str = "planned"
    test_manifest: str | list[str] | None = None
    test_fraction: float = 0.0

    def __post_init__(self) -> None:
        self.data_root = str(self.data_root)
        self.files = RemoteFiles(
            self.storage_options, self.file_cache_dir, self.file_cache_bytes, self.file_cache_policy
        )
        check_policy(self.on_broken_clip, BROKEN_CLIP_POLICIES, "on_broken_clip")
        require_existing("data_root", self.data_root)
        require_existing("tokenizer", self.tokenizer, only_if_local=True)
        check_policy(self.frame_accuracy, FRAME_ACCURACIES, "frame_accuracy")
        require_int("image_size", self.image_size, 1)
        require_int("num_video_tokens", self.num_video_tokens, 0)
        if self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {self.resize_mode!r}")
        check_held_out(("val_manifest", self.val_manifest, "val_fraction", self.val_fraction))
        check_held_out(("test_manifest", self.test_manifest, "test_fraction", self.test_fraction), self.val_fraction)
        self.layout = video_layout(self.dataset_type, self.data_root, dict(self.layout_options))
        self.layout.storage_options, self.layout.files = self.storage_options, self.files
        self.manifest = self.manifest or self.layout.default_manifest
        if self.manifest is None:
            raise ValueError(f"dataset_type {self.dataset_type!r} needs a manifest")
        self.sampler = frame_sampler(self.frame_sampling, self.max_frames, **self.frame_options)

    def prepare(self) -> None:
        self.layout.prepare(self.manifest)
        for manifest in (self.val_manifest, self.test_manifest):
            if manifest is not None:
                self.layout.prepare(manifest, self.manifest)

    def build(
        self, seq_len: int, pack_sequences: bool, job: Job | None = None
    ) -> tuple[VideoSamples, dict[str, VideoSamples]]:
        """Training samples and held-out samples by role, of ``seq_len`` tokens (``max_text_len``) each."""
        if pack_sequences:
            raise ValueError("video samples are not packed: use pack_sequences=False")
        tokenizer = load_pretrained("tokenizer", self.tokenizer)
        token_id = placeholder_token_id(tokenizer, self.tokenizer, self.image_token)
        labels = PromptAnswerLabels(
            tokenizer, self.tokenizer, seq_len, self.num_video_tokens, token_id, None, self.add_bos
        )
        pixels = ImagePixels(
            self.image_size, self.resize_mode, tuple(self.mean or CLIP_MEAN), tuple(self.std or CLIP_STD)
        )
        options = {
            "tokenizer": f"{self.tokenizer}:{len(tokenizer)}",
            "layout": [self.dataset_type, sorted(self.layout_options.items())],
            "frames": self.sampler.describe(),
            "image_size": self.image_size,
            "resize_mode": self.resize_mode,
            "normalization": pixels.normalization,
            "max_text_len": seq_len,
            "num_video_tokens": self.num_video_tokens,
            "prompt": self.prompt,
            **({"frame_accuracy": self.frame_accuracy} if self.frame_accuracy != "exact" else {}),
        }

        def samples(dataset: Any, split: RowSplit, split_name: str) -> VideoSamples:
            details = {**options, "data": dataset._fingerprint, "split": split_name, "rows": [split.first, len(split)]}
            where = f"{self.manifest}:{split_name}"
            return VideoSamples(
                dataset, split, self.data_root, self.sampler, pixels, labels, self.prompt, self.on_broken_clip,
                where, details, self.files, self.frame_accuracy,
            )  # fmt: skip

        train = self.layout.load(self.manifest, job=job)
        held = {}
        for role, manifest in (("validation", self.val_manifest), ("test", self.test_manifest)):
            if manifest is not None:
                dataset = self.layout.load(manifest, self.manifest, job)
                held[role] = samples(dataset, RowSplit(len(dataset)), role)
        fractions = {"validation": self.val_fraction, "test": self.test_fraction}
        rows, tails = held_out_rows(len(train), fractions, "clips")
        held.update({role: samples(train, split, "train" + HELD_OUT_NAMES[role]) for role, split in tails.items()})
        return samples(train, rows, "train"), held
