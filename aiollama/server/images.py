"""Pictures in chat requests: OpenAI ``image_url`` parts, read before the turn is appended.

A ``data:`` URL is always read. A URL to fetch (http or https) is fetched only by a server started
with ``fetch_images`` (``serve --fetch-images``), and then only from public addresses unless it
allows more (:mod:`aiollama.server.fetch`): otherwise a request could make the server reach any
address it can. Pictures are encoded on a worker thread, off the event loop, before the chat
turn that holds them is appended.
"""

from __future__ import annotations

from typing import Any

import anyio

from aiollama import Engine, Image
from aiollama.errors import AiollamaError
from aiollama.server.bad_request import BadRequest
from aiollama.server.fetch import Fetcher


async def read_images(engine: Engine, messages: list[dict[str, Any]], fetcher: Fetcher | None) -> None:
    """Replace each ``image_url`` part of ``messages`` with the picture it names, encoded; a URL
    to fetch only with a ``fetcher``."""
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
                    if fetcher is None:
                        raise BadRequest("this server fetches no image URLs: send the picture as a data: URL "
                                         "(or start the server with --fetch-images)", param=where)
                    image = Image(await anyio.to_thread.run_sync(fetcher.fetch, url, abandon_on_cancel=True))
                else:
                    image = Image.from_url(url)
                await engine.encode_images([image])
            except AiollamaError as exc:
                raise BadRequest(str(exc), param=where) from None
            content[j] = {"type": "image", "image": image}
