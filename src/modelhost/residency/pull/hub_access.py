"""The hub as a pull reaches it, through `huggingface_hub`: the endpoint (`HF_ENDPOINT`), the
token (`HF_TOKEN` or a `huggingface-cli login`), the cache (`HF_HUB_CACHE`, `HF_HOME/hub`:
the registry's), a repo's file list, a range of a file's bytes, and the hub's errors as a
pull's (404 naming the repo, 401 explaining a gated one, 503 offline).

The endpoint and cache are read when a pull starts, as the registry reads the cache."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx2  # huggingface_hub's HTTP client
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from modelhost.residency.pull.reference import HubReference, PullError

_TIMEOUT_S = 30.0


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def repo_info(reference: HubReference) -> Any:
    """The repo's `ModelInfo` at the reference's revision, with each file's size and checksum."""
    with hub_errors(reference):
        api = HfApi(endpoint=hub_endpoint())
        return api.model_info(reference.repo_id, revision=reference.revision, files_metadata=True)


def read_range(reference: HubReference, commit: str, filename: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file of the repo, by a range request (the rest is never read,
    even from a server that ignores the range)."""
    url = hf_hub_url(reference.repo_id, filename, revision=commit, endpoint=hub_endpoint())
    headers = build_hf_headers()
    headers["Range"] = f"bytes={start}-{end - 1}"
    headers["Accept-Encoding"] = "identity"
    wanted = end - start
    data = bytearray()
    with (
        hub_errors(reference),
        get_session().stream(
            "GET", url, headers=headers, follow_redirects=True, timeout=_TIMEOUT_S
        ) as response,
    ):
        if response.status_code >= 400:
            response.read()
            hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0  # the range was ignored
        for chunk in response.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            data += chunk
            if len(data) >= wanted:
                break
    return bytes(data[:wanted])


@contextmanager
def hub_errors(reference: HubReference) -> Iterator[None]:
    """The hub's exceptions inside the block, as PullErrors that say what to do."""
    repo = reference.repo_id
    try:
        yield
    except GatedRepoError as exc:
        raise PullError(
            401,
            f"repo '{repo}' is gated: accept its terms at https://huggingface.co/{repo} "
            "with your account, then set HF_TOKEN to an access token of that account "
            "(or run `hf auth login`) and pull again",
        ) from exc
    except RepositoryNotFoundError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", 404)
        message = f"repo '{repo}' was not found on {hub_endpoint()}"
        if status == 401:  # the hub answers a private repo, or none, without a token this way
            message += " (a private repo needs HF_TOKEN set to a token that can read it)"
        raise PullError(404, message) from exc
    except RevisionNotFoundError as exc:
        raise PullError(404, f"repo '{repo}' has no revision '{reference.revision}'") from exc
    except RemoteEntryNotFoundError as exc:
        raise PullError(404, f"a file of repo '{repo}' was not found: {exc}") from exc
    except OfflineModeIsEnabled as exc:
        raise PullError(
            503,
            "HF_HUB_OFFLINE is set: pulling needs the hub (models already in the cache are "
            "listed and served as they are)",
        ) from exc
    except HfHubHTTPError as exc:
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise PullError(
                401,
                f"the hub refused access to '{repo}' ({status}): check HF_TOKEN "
                "(a token that can read the repo, and the repo's terms accepted)",
            ) from exc
        raise PullError(502, f"the hub answered {status}: {str(exc).splitlines()[0]}") from exc
    except (httpx2.TransportError, ConnectionError) as exc:
        raise PullError(502, f"the hub at {hub_endpoint()} could not be reached: {exc}") from exc
