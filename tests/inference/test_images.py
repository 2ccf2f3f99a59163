"""Decoding an image part: the formats a user sends, and a 400 naming the part for the rest."""

from __future__ import annotations

import hashlib
import http.server
import io
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from PIL import Image
from vision_fake import base64_of, data_url, image_bytes

from modelhost.inference.contracts import InvalidRequest
from modelhost.inference.images import ImageLimits, ImagePart, decode_image

WHERE = "messages[0].content[1]"


def part(source: str) -> ImagePart:
    return ImagePart(WHERE, source)


@pytest.mark.parametrize(
    ("fmt", "mime"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")],
)
def test_each_accepted_format_decodes_with_its_size_and_digest(fmt: str, mime: str) -> None:
    data = image_bytes("blue", fmt, (40, 30))
    image = decode_image(part(data_url(data, mime)))
    assert (image.format, image.width, image.height) == (fmt, 40, 30)
    assert image.digest == hashlib.sha256(data).digest()
    assert image.rgb().mode == "RGB" and image.rgb().size == (40, 30)


def test_bare_base64_decodes_as_ollama_sends_it() -> None:
    image = decode_image(part(base64_of(image_bytes("red"))))
    assert image.format == "PNG"


def test_a_gif_reads_as_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    rgb = decode_image(part(data_url(out.getvalue(), "image/gif"))).rgb()
    red, green, blue = rgb.getpixel((4, 4))  # type: ignore[misc]
    assert red > 200 and blue < 50 and green < 50


def test_transparency_is_composited_onto_white() -> None:
    out = io.BytesIO()
    Image.new("RGBA", (4, 4), (0, 0, 0, 0)).save(out, format="PNG")
    assert decode_image(part(data_url(out.getvalue()))).rgb().getpixel((0, 0)) == (255, 255, 255)


def refusal(source: str, **caps: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        decode_image(part(source), ImageLimits(**caps))
    assert caught.value.status == 400
    assert caught.value.message.startswith(f"{WHERE}: ")
    assert caught.value.body["param"] == "messages"
    return caught.value


def test_bytes_that_are_no_image_are_refused() -> None:
    error = refusal(data_url(b"this is not an image"))
    assert "is not an image" in error.message


def test_a_truncated_image_is_refused() -> None:
    data = image_bytes("red", "PNG", (64, 64))
    error = refusal(data_url(data[: len(data) // 2]))
    assert error.body["code"] == "invalid_image"


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_other_formats_are_refused_by_name(fmt: str) -> None:
    error = refusal(data_url(image_bytes("red", fmt)))
    assert error.body["code"] == "unsupported_image_format"
    assert f"is a {fmt} image" in error.message


def test_an_image_over_the_pixel_cap_is_refused_before_it_is_decoded() -> None:
    error = refusal(data_url(image_bytes("red", "PNG", (40, 30))), max_pixels=1000)
    assert error.body["code"] == "image_too_large"
    assert "40x30 pixels" in error.message


def test_an_image_over_the_byte_cap_is_refused() -> None:
    error = refusal(data_url(image_bytes("red")), max_bytes=10)
    assert error.body["code"] == "image_too_large"


@pytest.mark.parametrize("url", ["https://example.com/cat.png", "http://127.0.0.1:8080/x.png"])
def test_a_remote_url_is_never_fetched(url: str) -> None:
    error = refusal(url)
    assert error.body["code"] == "image_url_not_allowed"
    assert "data URL" in error.message


def test_text_that_is_not_base64_is_refused() -> None:
    assert "not valid base64" in refusal("data:image/png;base64,@@@@").message


# ---------------------------------------------------------------------------------------------
# Fetching, where the operator allows it (--image-urls)


class _Images(http.server.BaseHTTPRequestHandler):
    files = {"/red.png": image_bytes("red"), "/big.png": image_bytes("red", "BMP", (100, 100))}

    def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join()


FETCH = ImageLimits(fetch_urls=True, fetch_timeout_s=10.0)


def test_an_allowed_url_is_fetched_and_decoded(image_host: str) -> None:
    image = decode_image(part(f"{image_host}/red.png"), FETCH)
    assert (image.format, image.width) == ("PNG", 32)


def test_a_url_that_answers_an_error_is_a_400_naming_the_part(image_host: str) -> None:
    error = refusal(f"{image_host}/missing.png", fetch_urls=True)
    assert error.body["code"] == "image_url_failed"
    assert "HTTP 404" in error.message


def test_a_fetched_image_over_the_cap_is_refused_without_reading_it_all(image_host: str) -> None:
    error = refusal(f"{image_host}/big.png", fetch_urls=True, max_bytes=1000)
    assert error.body["code"] == "image_too_large"


def test_a_host_that_does_not_answer_is_a_400(image_host: str) -> None:
    error = refusal("http://127.0.0.1:9/red.png", fetch_urls=True, fetch_timeout_s=5.0)
    assert error.body["code"] == "image_url_failed"
