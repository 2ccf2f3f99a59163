"""Images a request carries: where each part was, its bytes checked and decoded with Pillow.

A surface records each image part it reads as an `ImagePart` (where it is, for the 400 that
names it, and its source as the client sent it: a data URL or bare base64). The stage turns
them into `ImageInput`s once it knows the model has a vision tower (a text-only model answers
with the typed refusal of `media.py`, whatever the bytes), so a corrupt image is refused only
where it would have been read.

Accepted: PNG, JPEG, WebP and GIF (its first frame), what OpenAI and Anthropic accept. Refused
with a 400 naming the part: bytes that are not base64, an image Pillow cannot read or that is
cut short, any other format, more than `max_bytes` (the same cap `media.check_media_sizes`
applies at the edge) or more than `max_pixels` pixels (a small file that decompresses into
gigabytes). A remote http(s) URL is refused by default: fetching it, the server would make
requests on a client's behalf, to whatever its network reaches (server-side request forgery).
An operator who wants it says so (`--image-urls`, `ImageLimits.fetch_urls`): then the image is
fetched with a time limit and read no further than the byte cap.

Protocol-neutral and tensor-free: Pillow only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from modelhost.inference.contracts import ImagePart, InvalidRequest
from modelhost.inference.media import DEFAULT_MAX_IMAGE_BYTES, MiB

if TYPE_CHECKING:  # Pillow loads where an image is read: the front process never needs it
    from PIL import Image

__all__ = ["NO_FETCH", "ImageInput", "ImageLimits", "ImagePart", "decode_image", "decode_images"]

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192  # 64 MP: past any camera; a bomb's decoded size is capped
FETCH_TIMEOUT_S = 10.0
FETCH_REDIRECTS = 3


@dataclass(frozen=True, slots=True)
class ImageLimits:
    """What the server takes in an image, and whether it fetches image URLs at all."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_urls: bool = False  # --image-urls: the operator allows fetching http(s) URLs
    fetch_timeout_s: float = FETCH_TIMEOUT_S


NO_FETCH = ImageLimits()  # the defaults: inline images only


@dataclass(frozen=True, slots=True)
class ImageInput:
    """A decoded, checked image: its bytes and what they hold."""

    data: bytes = field(repr=False)
    digest: bytes  # sha256 of `data`: the image's identity (prefix cache, encoder cache)
    format: str  # one of FORMATS
    width: int
    height: int

    def rgb(self) -> Image.Image:
        """The image (a GIF's first frame) in RGB; transparency composited onto white, as
        transformers' processors convert it."""
        from PIL import Image

        image = Image.open(io.BytesIO(self.data))
        image.seek(0)
        if image.mode == "RGB":
            return image.convert("RGB")  # loaded: the file object is not kept open
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")


def image_refused(part: ImagePart, reason: str, code: str = "invalid_image") -> InvalidRequest:
    return InvalidRequest(f"{part.where}: {reason}", param=part.param, code=code)


def decode_image(part: ImagePart, limits: ImageLimits = NO_FETCH) -> ImageInput:
    """The part's image, checked; a 400 naming the part for anything this server cannot read.
    Blocking (it may fetch a URL): call it off the event loop."""
    from PIL import Image, UnidentifiedImageError

    max_bytes, max_pixels = limits.max_bytes, limits.max_pixels
    data = image_bytes(part, limits)
    if len(data) > max_bytes:
        over = f"is {len(data) / MiB:.1f} MiB; the limit is {max_bytes / MiB:.1f} MiB"
        raise _too_large(part, over)
    try:
        with warnings.catch_warnings():
            # Pillow warns (then fails) past its own pixel limit: here that is our refusal.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            size = image.size
            kind = image.format or "unknown"
            if kind not in FORMATS:
                accepted = "PNG, JPEG, WebP and GIF"
                reason = f"is a {kind} image; {accepted} images are accepted"
                raise image_refused(part, reason, "unsupported_image_format")
            if size[0] * size[1] > max_pixels:
                raise _too_large(part, _pixels(size, max_pixels))
            image.seek(0)
            image.load()  # the whole first frame: a truncated or corrupt file fails here
    except (Image.DecompressionBombWarning, Image.DecompressionBombError):
        raise _too_large(part, f"is over {max_pixels} pixels") from None
    except UnidentifiedImageError:
        raise image_refused(part, "is not an image (PNG, JPEG, WebP or GIF)") from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise image_refused(part, f"could not be decoded ({exc})") from None
    return ImageInput(data, hashlib.sha256(data).digest(), kind, size[0], size[1])


def decode_images(
    parts: Iterable[ImagePart], limits: ImageLimits = NO_FETCH
) -> tuple[ImageInput, ...]:
    return tuple(decode_image(part, limits) for part in parts)


def image_bytes(part: ImagePart, limits: ImageLimits = NO_FETCH) -> bytes:
    """The bytes a data URL or bare base64 string carries, or a URL where fetching is allowed
    (else a 400)."""
    source = part.source.strip()
    if source.lower().startswith(("http://", "https://")):
        if limits.fetch_urls:
            return fetch_image(part, source, limits)
        reason = (
            "remote image URLs are not fetched by this server; "
            "send the image inline as a data URL (data:image/png;base64,...)"
        )
        raise image_refused(part, reason, "image_url_not_allowed")
    payload = source
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise image_refused(part, "a data URL must be base64 (data:image/png;base64,...)")
    elif ":" in source[:12]:
        scheme = source.split(":", 1)[0]
        raise image_refused(part, f"{scheme}: URLs are not accepted; send a data URL")
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise image_refused(part, "is not valid base64") from None


def fetch_image(part: ImagePart, url: str, limits: ImageLimits) -> bytes:
    """GET `url` within the time limit, reading at most one byte past the cap (a larger
    image is refused without downloading the rest); a 400 naming the part when it fails."""
    import httpx  # only where an operator allowed fetching

    timeout = httpx.Timeout(limits.fetch_timeout_s)
    try:
        with (
            httpx.Client(
                timeout=timeout, follow_redirects=True, max_redirects=FETCH_REDIRECTS
            ) as client,
            client.stream("GET", url, headers={"Accept": "image/*"}) as response,
        ):
            if response.status_code != 200:
                reason = f"fetching the image URL answered HTTP {response.status_code}"
                raise image_refused(part, reason, "image_url_failed")
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > limits.max_bytes:
                    limit = f"{limits.max_bytes / MiB:.1f} MiB"
                    raise _too_large(part, f"at the URL is over the limit of {limit}")
            return bytes(data)
    except httpx.HTTPError as exc:
        reason = f"the image URL could not be fetched ({type(exc).__name__}: {exc})"
        raise image_refused(part, reason, "image_url_failed") from None


def _too_large(part: ImagePart, reason: str) -> InvalidRequest:
    return image_refused(part, f"image {reason}", "image_too_large")


def _pixels(size: tuple[int, int], max_pixels: int) -> str:
    return f"is {size[0]}x{size[1]} pixels; the limit is {max_pixels} pixels"
