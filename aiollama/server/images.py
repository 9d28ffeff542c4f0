"""Pictures in chat requests: OpenAI ``image_url`` parts, read before the turn is appended.

A ``data:`` URL is always read. A URL to fetch (http or https) is fetched only by a server started
with ``fetch_images`` (``serve --fetch-images``): otherwise a request could make the server reach
any address it can. Pictures are encoded on a worker thread, off the event loop, before the chat
turn that holds them is appended.
"""

from __future__ import annotations

import urllib.request
from typing import Any

import anyio

from aiollama import Engine, Image
from aiollama.errors import AiollamaError, ImageError
from aiollama.server.requests import BadRequest

MAX_FETCHED_BYTES = 32 * 2**20
FETCH_SECONDS = 20


async def read_images(engine: Engine, messages: list[dict[str, Any]], fetch: bool) -> None:
    """Replace each ``image_url`` part of ``messages`` with the picture it names, encoded."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if part.get("type") != "image_url":
                continue
            url = part["image_url"]["url"]
            where = f"messages[{i}].content[{j}].image_url"
            try:
                if url.startswith(("http://", "https://")):
                    if not fetch:
                        raise BadRequest("this server fetches no image URLs: send the picture as a data: URL "
                                         "(or start the server with --fetch-images)", param=where)
                    image = Image(await anyio.to_thread.run_sync(_fetch, url, abandon_on_cancel=True))
                else:
                    image = Image.from_url(url)
                await engine.encode_images([image])
            except AiollamaError as exc:
                raise BadRequest(str(exc), param=where) from None
            content[j] = {"type": "image", "image": image}


def _fetch(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=FETCH_SECONDS) as response:  # noqa: S310 (http(s) only, checked)
            data: bytes = response.read(MAX_FETCHED_BYTES + 1)
    except (OSError, ValueError) as exc:
        raise ImageError(f"the image at {url[:200]} could not be fetched: {exc}") from None
    if len(data) > MAX_FETCHED_BYTES:
        raise ImageError(f"the image at {url[:200]} is larger than {MAX_FETCHED_BYTES} bytes")
    return data
