"""``ImageTextSource``: a HuggingFace image-text dataset as a configured source (mixable by weight),
split into training and validation samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from datamodules.plan.arguments import check_split_options, require_existing, require_int
from datamodules.plan.bad_samples import check_policy
from datamodules.plan.held_out import HELD_OUT_NAMES, RowSplit, held_out_rows
from datamodules.plan.hf_loading import check_data_files, is_saved_dataset, load_pretrained, load_split
from datamodules.plan.loader import SourceSpec
from datamodules.plan.parallelism import Job
from datamodules.storage.remote_files import RemoteFiles
from datamodules.storage.sample_table import IndexedShards
from datamodules.vision.conversation_text import ConversationText
from datamodules.vision.image_text_samples import ImageTextFields, ImageTextSamples
from datamodules.vision.images import CLIP_MEAN, CLIP_STD, RESIZE_MODES, ImagePixels
from datamodules.vision.interleaved_rows import InterleavedRows
from datamodules.vision.interleaved_samples import InterleavedSamples
from datamodules.vision.interleaved_text import LAYOUTS, InterleavedText
from datamodules.vision.prompt_labels import PromptAnswerLabels, placeholder_token_id
from datamodules.vision.vlm_processor import ProcessorInputs
from datamodules.vision.webdataset_rows import WEBDATASET, WebDatasetRows, indexed_shards, split_shards

DEFAULT_IMAGE_SIZE = 224


def transform_name(transform: Callable[[Any], Any] | None) -> str | None:
    """What identifies a user transform across runs (torchvision's transforms print their settings)."""
    if transform is None or isinstance(transform, torch.nn.Module):
        return None if transform is None else repr(transform)
    return getattr(transform, "__qualname__", type(transform).__qualname__)


@dataclass
class ImageTextSource(SourceSpec):
    """Image-text pairs (captions, or prompts and answers) from a HuggingFace dataset.

    Args:
        path: a ``save_to_disk`` folder, or ``datasets.load_dataset``'s ``path``: ``"imagefolder"``
            (with ``data_dir`` in ``load_kwargs``, or ``data_files``; captions in ``metadata.jsonl``),
            ``"parquet"`` with ``data_files`` (an ``Image`` column), or a hub name; or
            ``"webdataset"``: WebDataset tar shards named by ``data_files`` (brace patterns such as
            ``s3://b/{00000..00099}.tar``, globs, a folder of ``.tar`` files, a list, or a dict by
            split), read by member through an index kept in ``load_kwargs["cache_dir"]`` (default
            ``~/.cache/datamodules/tar_index``; ``load_kwargs["allow_compressed_tar"]``: decompress a
            compressed shard there once instead of refusing it); the fields are then member keys, alternatives
            separated by ``;`` (``image_field="jpg;png;webp"``: the first the sample has) and
            ``"json:NAME"`` for a value in the sample's ``.json`` (``text_field="json:caption"``).
        tokenizer: a ``transformers`` tokenizer name or path; default: the processor's.
        processor: a ``transformers`` VLM processor name or path: its image processor makes the
            pixels, its chat template the prompt, and it fixes the image-token count (see
            ``ProcessorInputs``). ``None``: our resize and normalization, placeholders first.
        name: the dataset configuration. split: the training split.
        data_files: ``load_dataset``'s ``data_files``.
        image_field: the image column (``datasets.Image``, bytes, or a file path).
        text_field: the answer or caption column.
        prompt_field: the prompt column (default none).
        prompt: one prompt for every row, instead of a ``prompt_field`` (default none).
        image_size: pixels per side (default 224); with a processor, the processor's.
        resize_mode: ``"crop"`` (shorter side to ``image_size``, center crop; the default without a
            processor) or ``"square"``; a processor resizes in its own way, so it is refused there.
        mean, std: per-channel normalization (default OpenAI CLIP's); a processor uses its own.
        transform: replaces our resize: an RGB PIL image to a ``[3, image_size, image_size]``
            tensor (uint8 is then normalized by mean/std, float is kept), e.g. a
            ``torchvision.transforms.v2.Compose`` by class path in YAML.
        num_image_tokens: placeholder positions per image, without a processor (0: none).
        image_token: the placeholder's token, without a processor (default: the pad id).
        add_bos: without a processor, start each sample with the tokenizer's BOS token (a processor's
            chat template decides that; refused there).
        val_split: a split of the dataset for validation; or
        val_fraction: hold out this fraction of the rows, chosen by a fixed keyed shuffle (not the
            tail: datasets are often sorted), disjoint from training.
        test_split, test_fraction: the same for the test split (``Trainer.test``), disjoint from both.
        on_bad_sample: ``"raise"`` (default) or ``"skip"``: an unreadable image, a null text or a
            prompt too long for ``max_text_len`` is replaced by a stand-in drawn from its index,
            counted and logged.
        load_kwargs: further ``load_dataset`` arguments, e.g. ``{"data_dir": "images/"}``.
        storage_options: for a ``path``, ``data_files`` or image paths that are URLs (``s3://``,
            ``gs://``, ...), the fsspec filesystem's options (endpoint, credentials, ``anon``).
        file_cache_dir, file_cache_bytes: a node-local folder keeping images read by URL (each by
            its URL and version: a changed object is fetched again), shared by the node's ranks and
            workers, and the most bytes it holds; default: no cache.
        file_cache_policy: which images leave the cache when it is full: ``"planned"`` (default),
            the one the node's ranks read furthest ahead in the plan (an image read later than all of
            those is not kept: Belady's rule, the fewest fetches for a known order); ``"lru"``, the
            least recently used.
        layout: ``"pairs"`` (default): a row is one image and its text. ``"obelics"``: a row is an
            interleaved document, ``text_field`` and ``image_field`` lists of one length with a text
            or an image at each position; ``"mmc4"``: ``text_field`` a list of sentences and
            ``image_field`` a list of dicts, each an image (``image``, ``path`` or ``url``) and the
            ``matched_text_index`` of the sentence it goes before. A document becomes one row: its
            texts in order (``separator`` between two), each image its run of placeholders
            (``image_token``, needed; ``num_image_tokens`` of them, or the processor's); batches then
            carry ``pixel_values`` ``[N, 3, H, W]`` for the batch's ``N`` images, in order, and
            ``image_sample_index`` ``[N]``, the row of each. ``"chat"``: a row is a conversation,
            ``text_field`` its messages (OpenAI ``[{role, content}]`` or ShareGPT ``[{from, value}]``),
            contents with ``{"type": "image"}`` parts where images go, ``image_field`` its images in
            that order; rendered by the processor's chat template (else the tokenizer's), labels
            on the assistant's tokens only. A tar sample's ``.json`` may hold a document's order,
            its image list naming the sample's members (``image_field="json:images"``). A processor
            whose image-token count depends on the image's size (Qwen2-VL) is taken by these layouts:
            ``pixel_values`` are then its rows of patches, with its per-image outputs
            (``image_grid_thw``) beside them.
        max_images: with an interleaved layout, the most images a document may hold (more is a bad
            sample); documents cut at ``max_text_len`` keep their first images whose placeholders fit.
        separator: with an interleaved layout, the text between two adjacent texts.
        loss_before_first_image: with an interleaved layout, whether the text before a document's
            first image takes loss (default: yes).
        max_images_per_row: with packed interleaved documents (``pack_sequences=True``), the most
            images a row holds (default: no cap beyond the tokens). A document takes the room of its
            tokens or of its share of the row's images, whichever is more; the cap costs no room
            where ``max_text_len / max_images_per_row`` is at most an image's tokens.
    """

    path: str
    tokenizer: str | None = None
    processor: str | None = None
    name: str | None = None
    split: str = "train"
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    image_field: str = "image"
    text_field: str = "text"
    prompt_field: str | None = None
    prompt: str = ""
    image_size: int | None = None
    resize_mode: str | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    transform: Callable[[Any], Any] | None = None
    num_image_tokens: int | None = None
    image_token: str | None = None
    add_bos: bool = False
    val_split: str | None = None
    val_fraction: float = 0.0
    on_bad_sample: str = "raise"
    load_kwargs: dict[str, Any] = field(default_factory=dict)
    storage_options: dict[str, Any] | None = None
    file_cache_dir: str | None = None
    file_cache_bytes: int | None = None
    file_cache_policy: str = "planned"
    test_split: str | None = None
    test_fraction: float = 0.0
    layout: str = "pairs"
    max_images: int = 16
    separator: str = "\n\n"
    loss_before_first_image: bool = True
    max_images_per_row: int | None = None

    def __post_init__(self) -> None:
        self.path = str(self.path)
        if self.max_images_per_row is not None:
            require_int("max_images_per_row", self.max_images_per_row, 1)
            if self.layout == "pairs":
                raise ValueError(
                    "max_images_per_row is for packed interleaved documents (layout 'obelics', 'mmc4' or 'chat')"
                )
        if self.layout not in ("pairs", *LAYOUTS):
            raise ValueError(f"layout must be one of {('pairs', *LAYOUTS)}, got {self.layout!r}")
        require_int("max_images", self.max_images, 1)
        if self.layout != "pairs":
            if self.prompt_field is not None or self.prompt:
                raise ValueError(f"layout={self.layout!r} has no prompt: prompt and prompt_field are for pairs")
            if self.processor is None and self.image_token is None:
                raise ValueError(f"layout={self.layout!r} needs image_token: the token each image's placeholders are")
        if self.layout == "chat":  # the chat template renders the whole conversation
            given = {"add_bos": self.add_bos, "separator": self.separator != "\n\n"}
            given["loss_before_first_image"] = not self.loss_before_first_image
            clash = [option for option, set_ in given.items() if set_]
            if clash:
                raise ValueError(
                    f"{clash} cannot be combined with layout='chat': the chat template renders the conversation "
                    "and labels are on the assistant's tokens"
                )
        self.files = RemoteFiles(
            self.storage_options, self.file_cache_dir, self.file_cache_bytes, self.file_cache_policy
        )
        check_policy(self.on_bad_sample)
        if self.path == WEBDATASET:
            for split in (self.split, self.val_split, self.test_split):
                if split is not None:
                    split_shards(self.data_files, split)
            unknown = sorted(set(self.load_kwargs) - {"cache_dir", "allow_compressed_tar"})
            if unknown or self.name is not None:
                got = "name" if self.name is not None else f"load_kwargs {unknown}"
                raise ValueError(
                    f"path={WEBDATASET!r} takes data_files and load_kwargs 'cache_dir' (the tar index cache) and "
                    f"'allow_compressed_tar' only; got {got}"
                )
        else:
            check_data_files(self.path, self.data_files)
        for option in ("path", "tokenizer", "processor"):
            require_existing(option, getattr(self, option), only_if_local=True)
        if self.image_size is not None:
            require_int("image_size", self.image_size, 1)
        if self.resize_mode is not None and self.resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {self.resize_mode!r}")
        check_split_options(self.split, self.val_split, self.val_fraction, self.test_split, self.test_fraction)
        if self.prompt_field is not None and self.prompt:
            raise ValueError(f"give prompt_field ({self.prompt_field!r}) or prompt ({self.prompt!r}), not both")
        if self.processor is None:
            if self.tokenizer is None:
                raise ValueError("give a tokenizer (name or path), or a processor whose tokenizer is used")
            if self.num_image_tokens is None:
                raise ValueError(
                    "num_image_tokens is needed without a processor: the placeholder positions per image "
                    "(the vision encoder's output length; 0 for none)"
                )
            require_int("num_image_tokens", self.num_image_tokens, 0)
        else:
            given = {"mean": self.mean, "std": self.std, "transform": self.transform, "image_token": self.image_token}
            given.update(resize_mode=self.resize_mode, add_bos=self.add_bos or None)
            clash = [k for k, v in given.items() if v is not None]
            if clash:
                raise ValueError(f"{clash} cannot be combined with processor {self.processor!r}, which sets them")

    def _shards(self, split: str, job: Job | None) -> IndexedShards:
        """The tar shards of ``split``, indexed once for the job (``path="webdataset"``)."""
        cache, compressed = self.load_kwargs.get("cache_dir"), self.load_kwargs.get("allow_compressed_tar", False)
        return indexed_shards(split_shards(self.data_files, split), cache, self.storage_options, compressed, job)

    def _load(self, split: str, job: Job | None = None) -> Any:
        if self.path == WEBDATASET:
            fields = {self.image_field: self.image_field, self.text_field: self.text_field}
            if self.prompt_field is not None:
                fields[self.prompt_field] = self.prompt_field
            return WebDatasetRows(self._shards(split, job), fields, (self.image_field,), self.files)
        return load_split(
            self.path, split, self.name, self.data_files, self.load_kwargs, storage_options=self.storage_options
        )

    def prepare(self) -> None:
        # Once per node: datasets' Arrow cache, which every rank then reads. Tar shards are indexed in
        # ``build`` instead, where the job's ranks share the work.
        if self.path != WEBDATASET and not is_saved_dataset(self.path, self.storage_options):
            for split in (self.split, self.val_split, self.test_split):
                if split is not None:
                    self._load(split)

    def _dataset(self, split: str, job: Job | None) -> Any:
        import datasets

        dataset = self._load(split, job)
        if self.path == WEBDATASET:
            if len(dataset) == 0:
                raise ValueError(f"the tar shards of split {split!r} hold no sample")
            return dataset
        for column in (self.image_field, self.text_field, self.prompt_field):
            if column is not None and column not in dataset.column_names:
                raise ValueError(
                    f"{self.path} split {split!r} has no column {column!r}; columns are {dataset.column_names}"
                )
        if len(dataset) == 0:
            raise ValueError(f"{self.path} split {split!r} has no rows")
        columns = [c for c in (self.image_field, self.text_field, self.prompt_field) if c is not None]
        dataset = dataset.select_columns(columns)
        feature = dataset.features[self.image_field]
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(self.image_field, datasets.Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), datasets.Image):  # a document's list of images
            dataset = dataset.cast_column(self.image_field, datasets.Sequence(datasets.Image(decode=False)))
        return dataset

    def _pixels_and_labels(self, max_text_len: int) -> tuple[ImagePixels | ProcessorInputs, PromptAnswerLabels, str]:
        if self.processor is not None:
            inputs = ProcessorInputs(self.processor)
            tokenizer = inputs.tokenizer if self.tokenizer is None else load_pretrained("tokenizer", self.tokenizer)
            for what, ours, theirs in (
                ("image_size", self.image_size, None if inputs.dynamic else inputs.pixel_shape[-1]),
                ("num_image_tokens", self.num_image_tokens, inputs.num_image_tokens or "a count by image size"),
            ):
                if ours is not None and ours != theirs:
                    raise ValueError(f"{what}={ours}, but processor {self.processor!r} gives {theirs}")
            if inputs.dynamic and self.layout == "pairs":
                raise ValueError(
                    f"processor {self.processor!r} gives each image as many tokens as its size asks; image-text "
                    "pairs need a fixed count (every batch one shape): use a fixed-resolution processor, or an "
                    "interleaved layout, which takes either"
                )
            image_token_id = inputs.image_token_id
            template, count, pixels = inputs.template, inputs.num_image_tokens or 0, inputs
        else:
            tokenizer = load_pretrained("tokenizer", self.tokenizer)
            image_token_id = placeholder_token_id(tokenizer, self.tokenizer, self.image_token)
            template, count = None, self.num_image_tokens
            pixels = ImagePixels(
                self.image_size or DEFAULT_IMAGE_SIZE,
                self.resize_mode or "crop",
                tuple(self.mean or CLIP_MEAN),
                tuple(self.std or CLIP_STD),
                self.transform,
            )
        name = self.tokenizer or self.processor
        labels = PromptAnswerLabels(tokenizer, name, max_text_len, count, image_token_id, template, self.add_bos)
        return pixels, labels, f"{name}:{len(tokenizer)}"

    def build(
        self, seq_len: int, pack_sequences: bool, job: Job | None = None
    ) -> tuple[ImageTextSamples, dict[str, ImageTextSamples]]:
        """Training samples and held-out samples by role, of ``seq_len`` tokens (``max_text_len``) each."""
        if self.max_images_per_row is not None and not pack_sequences:
            raise ValueError(
                f"max_images_per_row={self.max_images_per_row} caps packed rows: it needs pack_sequences=True"
            )
        if pack_sequences and self.layout == "pairs":
            raise ValueError(
                "image-text pairs are not packed: pack_sequences is for interleaved documents (layout 'obelics', "
                "'mmc4' or 'chat')"
            )
        pixels, labels, tokenizer = self._pixels_and_labels(seq_len)
        fields = ImageTextFields(self.image_field, self.text_field, self.prompt_field, self.prompt)
        options = {
            "tokenizer": tokenizer,
            "processor": self.processor,
            "fields": [self.image_field, self.text_field, self.prompt_field, self.prompt],
            "image_size": pixels.pixel_shape[-1] if isinstance(pixels, ProcessorInputs) else pixels.shape[-1],
            "resize_mode": self.resize_mode or "crop",
            "transform": transform_name(self.transform),
            "max_text_len": seq_len,
            "num_image_tokens": "by image size" if getattr(pixels, "dynamic", False) else labels.num_image_tokens,
        }

        text = None
        if self.layout != "pairs":
            image_token = self.image_token or pixels.image_token  # a processor's, where no image_token is given
            count = None if getattr(pixels, "dynamic", False) else labels.num_image_tokens
            name = self.tokenizer or self.processor
            if self.layout == "chat":  # the processor's chat template, else the tokenizer's own
                template = pixels.chat_template if isinstance(pixels, ProcessorInputs) else None
                text = ConversationText(labels.tokenizer, name, seq_len, count, image_token, template)
            else:
                text = InterleavedText(
                    labels.tokenizer, name, seq_len, count, image_token, self.separator,
                    self.loss_before_first_image, self.add_bos,
                )  # fmt: skip
            options.update(layout=self.layout, max_images=self.max_images, separator=self.separator)
            options.update(loss_before_first_image=self.loss_before_first_image)
            if pack_sequences:
                options.update(packed=True, max_images_per_row=self.max_images_per_row)

        def samples(dataset: Any, split: RowSplit, split_name: str) -> ImageTextSamples | InterleavedSamples:
            details = {**options, "data": dataset._fingerprint, "split": split_name, "rows": [split.first, len(split)]}
            where = f"{self.path}:{split_name}"
            if text is not None and pack_sequences:
                return InterleavedRows(
                    dataset, split, self.layout, self.text_field, self.image_field, pixels, text, self.max_images,
                    self.on_bad_sample, where, details, self.files, max_images_per_row=self.max_images_per_row, job=job,
                )  # fmt: skip
            if text is not None:
                return InterleavedSamples(
                    dataset, split, self.layout, self.text_field, self.image_field, pixels, text, self.max_images,
                    self.on_bad_sample, where, details, self.files,
                )  # fmt: skip
            return ImageTextSamples(
                dataset, split, fields, pixels, labels, self.on_bad_sample, where, details, self.files
            )

        train = self._dataset(self.split, job)
        held = {}
        for role, split in (("validation", self.val_split), ("test", self.test_split)):
            if split is not None:
                dataset = self._dataset(split, job)
                held[role] = samples(dataset, RowSplit(len(dataset)), split)
        fractions = {"validation": self.val_fraction, "test": self.test_fraction}
        rows, tails = held_out_rows(len(train), fractions, "rows")
        held.update({role: samples(train, split, self.split + HELD_OUT_NAMES[role]) for role, split in tails.items()})
        return samples(train, rows, self.split), held
