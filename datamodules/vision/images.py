"""Image decoding every vision source shares: bytes or a file to an RGB PIL image (any mode, EXIF
orientation applied, truncation detected), and the default resize through ``torchvision.transforms.v2``.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageFile, ImageOps, UnidentifiedImageError
from torchvision.transforms import v2

from datamodules.plan.bad_samples import BadSample
from datamodules.storage.remote_files import LOCAL_FILES, RemoteFiles

RESIZE_MODES = ("square", "crop")
# OpenAI CLIP's statistics, which most open VLM vision towers (LLaVA's among them) were trained with.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def image_reference(value: Any) -> tuple[bytes | None, str | None]:
    """``(bytes, path)`` of a row's image value: ``datasets``' undecoded ``Image`` dict, bytes, a path
    or URL, or ``None`` (which ``read_image`` refuses as a null image)."""
    if isinstance(value, dict):
        return value.get("bytes"), value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    if isinstance(value, str) or value is None:
        return None, value
    raise BadSample(f"its image is a {type(value).__name__}, not bytes or a path")


def image_bytes(data: bytes | None, path: str | None, files: RemoteFiles = LOCAL_FILES) -> bytes:
    """``data``, or (where it is ``None``) the bytes of the file at ``path``, local or a URL."""
    if data is not None:
        return data
    if path is None:
        raise BadSample("the image is null (no bytes and no path)")
    try:
        return files.read_bytes(path)
    except OSError as err:
        raise BadSample(f"cannot read image file {path}: {err.strerror or err}") from None


def read_image(
    data: bytes | None, path: str | None, draft_size: int | None = None, files: RemoteFiles = LOCAL_FILES
) -> Image.Image:
    """The RGB image in ``data`` (or, when ``data`` is ``None``, the file at ``path``, a local path or
    a URL read through ``files``).

    Every mode becomes RGB as ``transformers``' image processors make it: alpha and palette
    transparency composited onto white; 16-bit and 32-bit greyscale scaled to 8 bits (PIL's own
    conversion would clip them); the rest through PIL's ``convert("RGB")`` (palette, L, CMYK...).
    The EXIF orientation is applied. A truncated file raises ``BadSample`` even where
    ``PIL.ImageFile.LOAD_TRUNCATED_IMAGES`` was set, which would decode the missing part as grey.
    ``draft_size``: a JPEG may be decoded at a reduced DCT scale (1/2, 1/4, 1/8) while both sides
    stay at least this large, several times cheaper than a full decode before a downscale.
    """
    data = image_bytes(data, path, files)
    if not data:
        raise BadSample("the image file is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data))
        if draft_size is not None and image.format == "JPEG":
            image.draft(None, (draft_size, draft_size))
        truncated_allowed, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
        try:
            image.load()
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = truncated_allowed
        image = ImageOps.exif_transpose(image)
    except UnidentifiedImageError:
        raise BadSample(f"not an image format PIL can read ({len(data)} bytes starting {data[:8]!r})") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:
        raise BadSample(f"cannot decode the image, truncated or corrupt ({err})") from None
    return to_rgb(image)


def image_size(data: bytes | None, path: str | None, files: RemoteFiles = LOCAL_FILES) -> tuple[int, int]:
    """``(width, height)`` of the image ``read_image`` gives, from its header alone (the EXIF
    orientation applied): no pixel is decoded."""
    data = image_bytes(data, path, files)
    try:
        image = Image.open(io.BytesIO(data))
        turned = image.getexif().get(ExifTags.Base.Orientation) in (5, 6, 7, 8)  # a quarter turn: sides swap
    except UnidentifiedImageError:
        raise BadSample(f"not an image format PIL can read ({len(data)} bytes starting {data[:8]!r})") from None
    except (OSError, ValueError, SyntaxError) as err:
        raise BadSample(f"cannot read the image's header ({err})") from None
    return (image.height, image.width) if turned else (image.width, image.height)


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` in RGB (see ``read_image``)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("I", "F") or image.mode.startswith("I;16"):
        values = np.asarray(image)
        top = 65535 if image.mode != "F" or values.max() > 255 else 255
        grey = (np.clip(values.astype(np.float64), 0, top) * (255 / top)).round().astype(np.uint8)
        return Image.fromarray(grey, "L").convert("RGB")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


class ResizeImage:
    """The default image transform: an RGB PIL image to a ``uint8`` tensor ``[3, size, size]``.

    Args:
        image_size: output side in pixels.
        resize_mode: ``"square"`` resizes to ``size x size`` (the aspect ratio is not kept);
            ``"crop"`` resizes the shorter side to ``size`` and crops the center square.
    """

    def __init__(self, image_size: int, resize_mode: str = "crop") -> None:
        if resize_mode not in RESIZE_MODES:
            raise ValueError(f"resize_mode must be one of {RESIZE_MODES}, got {resize_mode!r}")
        self.image_size = image_size
        if resize_mode == "square":
            self.resize = v2.Resize((image_size, image_size), antialias=True)
        else:
            self.resize = v2.Compose([v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)])

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.resize(v2.functional.pil_to_tensor(image))


def checked_pixels(pixels: Any, image_size: int, transform: Callable[..., Any]) -> np.ndarray:
    """A transform's output as a ``[3, image_size, image_size]`` array (``uint8``, or float32)."""
    if isinstance(pixels, torch.Tensor):
        pixels = pixels.numpy()
    pixels = np.asarray(pixels)
    if pixels.shape != (3, image_size, image_size):
        raise ValueError(
            f"the image transform {transform!r} returned shape {tuple(pixels.shape)}; "
            f"a tensor [3, {image_size}, {image_size}] (image_size) is needed, so every batch has one shape"
        )
    return pixels if pixels.dtype == np.uint8 else pixels.astype(np.float32, copy=False)


class ImagePixels:
    """RGB images to pixel arrays of one shape, and batches of them to normalized float tensors.

    Our path (``transform=None``): ``ResizeImage``, uint8 arrays through the DataLoader and to the
    device (a quarter of float32's bytes), scaled by ``mean``/``std`` there (``normalize``, from the
    DataModule's ``on_after_batch_transfer``). A user
    ``transform`` replaces the resize: an RGB PIL image in, a ``[3, image_size, image_size]``
    tensor out; a uint8 tensor is then normalized as ours, a float tensor is used as it is.
    """

    def __init__(
        self,
        image_size: int,
        resize_mode: str = "crop",
        mean: tuple[float, ...] = CLIP_MEAN,
        std: tuple[float, ...] = CLIP_STD,
        transform: Callable[[Image.Image], Any] | None = None,
    ) -> None:
        if len(mean) != 3 or len(std) != 3 or not all(s > 0 for s in std):
            raise ValueError(f"mean and std need 3 values (RGB), std > 0; got mean={mean}, std={std}")
        self.shape = (3, image_size, image_size)
        self.transform = ResizeImage(image_size, resize_mode) if transform is None else transform
        # Our resize may decode a JPEG at a reduced scale; a user transform sees the full image, and
        # may draw random numbers (augmentation).
        self.user_transform = transform is not None
        self.draft_size = None if self.user_transform else image_size
        self.normalization = f"mean={tuple(mean)} std={tuple(std)}"
        std_ = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
        self._scale = 1.0 / (255.0 * std_)
        self._shift = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1) / std_

    def __call__(self, image: Image.Image) -> np.ndarray:
        return checked_pixels(self.transform(image), self.shape[1], self.transform)

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 pixels (channels third from last, on any device) to float32 ``(x / 255 - mean) / std``;
        float pixels (a user transform's, a processor's) are returned as they are."""
        if pixels.dtype != torch.uint8:
            return pixels
        scale, shift = (t.view(3, 1, 1).to(pixels.device) for t in (self._scale, self._shift))
        return pixels.to(torch.float32).mul_(scale).sub_(shift)
