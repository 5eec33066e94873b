"""Everything vitconvert asks of huggingface_hub below the jobs: repo ids, the offline switch, the local cache,
tokens, one snapshot download, and one line for each Hub failure. The token never leaves these functions
except into huggingface_hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

from .errors import VitconvertError, first_line, param

LOGIN_HINT = f"run `hf auth login` (or `huggingface-cli login`), set HF_TOKEN, or pass {param('token')}"


def parse_repo_id(text: str, revision_allowed: bool = True) -> tuple[str, Optional[str]]:
    """The one repo-id parser: ``[hf-hub:]org/name[@revision]`` -> ("org/name", revision or None), refusing
    what the Hub would refuse; without ``revision_allowed`` (push: the branch is its own option) ``@`` is
    refused too."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo, at, revision = (text or "").strip().removeprefix("hf-hub:").partition("@")
    if at and not revision_allowed:
        raise VitconvertError(f"invalid repo id {text!r}: give the branch with {param('revision')}, not @")
    try:
        validate_repo_id(repo)
    except HFValidationError:
        repo = ""
    if repo.count("/") != 1:
        kind, form = ("Hub", "org/name[@revision]") if revision_allowed else ("repo", "org/name")
        raise VitconvertError(f"invalid {kind} id {text!r}: expected {form} (a user or organisation name, a slash, "
                              "then letters, digits, '-', '_' or '.')")
    return repo, revision or None


def check_endpoint() -> None:
    """HF_ENDPOINT, when set, is where every Hub request goes: a malformed one ("hub.local", "https//x") is said
    in one line before any request, not as the HTTP library's protocol error."""
    text = os.environ.get("HF_ENDPOINT")
    if text is None:
        return
    parsed = urlparse(text.strip())
    try:
        parsed.port  # noqa: B018 (a port that is no number raises)
        fine = parsed.scheme in ("http", "https") and bool(parsed.hostname) and not any(c.isspace() for c in text)
    except ValueError:
        fine = False
    if not fine:
        raise VitconvertError(f"HF_ENDPOINT={text!r} is not a Hub address: expected http(s)://HOST[:PORT] (unset it "
                              "for https://huggingface.co)")


def hub_snapshot(repo: str, revision: Optional[str] = None) -> Path:
    """Download (or find in the cache, offline) a Hub repo's config + weights; returns the snapshot folder.
    ``repo`` is an id ``parse_repo_id`` returned (sources.resolve parses ``hf-hub:`` strings)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    if not hub_offline():
        check_endpoint()
    try:
        return Path(snapshot_download(repo, revision=revision,
                                      allow_patterns=["config.json", "*.safetensors", "README.md", "*.yaml"]))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError) as e:
        where = f"{repo}@{revision}" if revision else repo
        offline = hub_offline()
        if offline and isinstance(e, LocalEntryNotFoundError):
            cached = cached_revisions(repo)
            have = f"cached revisions: {', '.join(cached)}" if cached else "nothing of this repo is cached"
            raise VitconvertError(f"{where} is not in the Hub cache and HF_HUB_OFFLINE is set ({have}); "
                                  "unset HF_HUB_OFFLINE to download it") from None
        cause = e.__cause__  # huggingface_hub's own line starts "Got: ConnectError: ..." mid-sentence
        if isinstance(e, LocalEntryNotFoundError) and isinstance(cause, _connection_errors()) and not offline:
            raise VitconvertError(f"cannot reach the Hugging Face Hub to get {where} ({type(cause).__name__}: "
                                  f"{first_line(cause)}) and it is not in the Hub cache: check the network (or "
                                  "HF_ENDPOINT), or download it on a machine that has one") from None
        hint = " (HF_HUB_OFFLINE is set and it is not in the Hub cache)" if offline else ""
        raise VitconvertError(f"cannot get {where} from the Hugging Face Hub{hint}: {first_line(e)}") from None


def token_source(token: Optional[str]) -> Optional[str]:
    """Where a token would come from, without reading it over the network (dry runs stay offline)."""
    from huggingface_hub import constants

    if token:
        return "--token"
    if os.environ.get("HF_TOKEN"):
        return "HF_TOKEN"
    return "cached login" if Path(constants.HF_TOKEN_PATH).is_file() else None


def resolve_token(token: Optional[str]) -> str:
    """--token, else HF_TOKEN, else the cached login; none is one line saying how to log in."""
    import huggingface_hub

    if token:
        return token
    try:
        found = os.environ.get("HF_TOKEN") or huggingface_hub.get_token()
    except Exception as e:  # e.g. a failed OIDC exchange
        raise VitconvertError(f"cannot get a Hugging Face token ({type(e).__name__}); {LOGIN_HINT}") from None
    if not found:
        raise VitconvertError(f"no Hugging Face token found: {LOGIN_HINT}")
    return found


def cached_revisions(repo_id: str) -> list[str]:
    """Branches/tags of ``repo_id`` in the local Hub cache (its refs/), for the offline error message."""
    from huggingface_hub import constants

    refs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs"
    return sorted(str(p.relative_to(refs)) for p in refs.rglob("*") if p.is_file()) if refs.is_dir() else []


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (its constant, set at its import, also covers
    TRANSFORMERS_OFFLINE), or set since then, parsed with its own list of true values ("off" is online)."""
    from huggingface_hub import constants

    now = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in constants.ENV_VARS_TRUE_VALUES
    return now or bool(constants.HF_HUB_OFFLINE)


HUB_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in timm's order: safetensors first, its pickle else


def cached_weights(spec: str) -> list[Path]:
    """The weights file of an ``[hf-hub:]org/name[@revision]`` in the Hub cache, the one timm would load
    (model.safetensors, else timm's pickled pytorch_model.bin); empty when not cached. No network call: the one
    answer to "are its weights here?" (vitconvert's model threads, a timm name's reachability, the mark check)."""
    from huggingface_hub import try_to_load_from_cache

    repo_id, revision = parse_repo_id(spec)
    for name in HUB_WEIGHTS:
        found = try_to_load_from_cache(repo_id, name, revision=revision)
        if isinstance(found, str):
            return [Path(found)]
    return []


def hub_reachable(timeout: float = 5.0) -> bool:
    """One HEAD request to the Hub, no retries: huggingface_hub itself retries a refused connection five times
    per file with backoff, a minute of 'Retrying in 8s' lines before the error an offline machine gets anyway."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=timeout)
    except Exception:  # refused, unresolvable, timed out, a proxy that answers nothing
        return False
    return True


def _connection_errors() -> tuple[type[BaseException], ...]:
    """Connection failures of whichever HTTP library this huggingface_hub uses (httpx or requests)."""
    import importlib

    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError"),
                         ("requests", "Timeout")):
        try:
            errors.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def describe_hub_error(e: BaseException, repo_id: str, token: str, stage: str) -> str:
    """One line for any failure of the Hub calls, with the token scrubbed from whatever the server said."""
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    first = first_line(e)
    nothing = "nothing was committed (the upload is a single commit)"
    if isinstance(e, RepositoryNotFoundError):
        msg = f"cannot access {repo_id}: it does not exist or your token cannot write to it; {LOGIN_HINT}"
    elif isinstance(e, HfHubHTTPError):
        code = getattr(getattr(e, "response", None), "status_code", None)
        if code == 401:
            msg = f"the Hub refused the token (401 Unauthorized); {LOGIN_HINT}"
        elif code == 403:
            msg = f"your token may not write to {repo_id} (403 Forbidden): use a token with write access; {nothing}"
        else:
            msg = f"the Hub failed to {stage} {repo_id} ({code or 'HTTP error'}: {first}); {nothing}"
    elif isinstance(e, _connection_errors()):
        msg = f"cannot reach the Hugging Face Hub to {stage} {repo_id} ({type(e).__name__}: {first}); {nothing}"
    else:
        msg = f"push to {repo_id} failed while trying to {stage} ({type(e).__name__}: {first}); {nothing}"
    return msg.replace(token, "***") if token else msg


