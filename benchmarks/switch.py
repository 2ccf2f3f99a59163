"""The switch: two models under a budget that holds one, alternated, against llama-server's
router on the same files, one run (issue 35).

    python benchmarks/switch.py [A.gguf B.gguf] [--rounds 2] [--prompt-tokens 1200]
        [--tokens 16] [--model-budget 3.2] [--servers modelhost,llama-server]
        [--llama-server PATH] [--modelhost-args ARGS] [--llama-args ARGS]
        [--packed-weights fresh|warm] [--out FILE]

The files default to the Llama-shaped 1B and 3B Q4_K_M files of `synthetic_gguf.py` under
/tmp/synth-models (written there when missing, under a temporary name then renamed: other runs
share them). Each server runs alone on the machine and is asked, model A, B, A, B, ... for
2 x `--rounds` visits each, a streamed text completion of ~`--prompt-tokens` words (about as
many tokens) and `--tokens` tokens (ignore_eos: the weights are random), temperature 0.
A model's visits alternate between:

- switch: the model is not resident and the prompt is new (no cache can help): the time to its
  first token is what a spare worker shortens;
- return: the model is not resident and the prompt is the one it saw on its previous visit:
  what a prefix cache that outlives the worker shortens; the cached tokens it reports are kept
  (`usage.prompt_tokens_details.cached_tokens` on modelhost, `timings.cache_n` on
  llama-server, with `prompt_n` the tokens it computed);

and each visit is followed by the same request again, the model resident (`resident`). The very
first visit of A only warms the server up (modelhost has A loaded at start) and is left out.
After the last visit, once the spare is warm and `QUIET_S` have passed, the last resident
request is sent once more (`quiet`): `resident` over `quiet` is what switching back to back
costs a model that is answering (issue 48's target: at most 2x).

Servers: `modelhost` is `modelhost serve A B --model-budget GB --hold 0 --log-level info` (a
spare worker kept warm, the default; no hold, which would keep a model 5 s after its answer for
an agent's next call, where this client switches on purpose); `modelhost-no-spare` adds
`--no-spare-worker`, `modelhost-no-fork` `--no-fork-server` (spares and workers spawned and
warmed up afresh, as before the fork server); `llama-server` is the router (`--models-dir` over
a folder of links to both files, `--models-max 1`) with `user_sized.py`'s settings (`-np 8 -c
16384 -t 2`), a model named by its file's stem. Each switch and return also says where its time
went (`phases`, ms). For modelhost: the drain of the other model (from the server's log), the
new worker's start (`GET /engine`: waiting for a spare, Python, imports, weights and tokenizer,
engine, listening) and the rest (prefill and the first token). For llama-server, from its log
(the router's clock and its new instance's): the drain (evicting the other -> its instance
exited), the instance's start (spawned -> its model load began), its load (weights, context and
warm-up -> model loaded), listening (-> the router proxies the request), the prefill (its
prompt eval time) and the rest. The memory of each server's process tree is sampled throughout
(peak), and the spare's RSS read from `/engine`. Prints a table of medians and writes JSON
(default benchmarks/results/switch-<time>.json).

Each request has a connection of its own: llama-server's router closed a kept-alive connection
as the next request arrived on it, right after a stream ("Server disconnected without sending a
response"; earlier runs ended there). A request that still meets a connection closed before any
answer within a second is sent once more (`retried` in its row). `--prompt-tokens` sets the
prompt's length (the issue's own measurement used ~980 tokens, this benchmark 1,200: a word of
`prompt_text` is about a token); `--modelhost-args` adds flags to modelhost's command line (e.g.
"--prompt-activations 8").

modelhost runs in a home of its own (no KV store or packed weights from earlier runs).
`--packed-weights warm` first loads both files there once, so that every load in the run maps
their packed weights, as on a server that has met these files before; `fresh` (the default)
leaves the first load of each file to repack it and write them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup
from user_sized import (
    LLAMA_SERVER_ARGS,
    LLAMA_SERVER_CANDIDATES,
    free_port,
    fresh_home,
    git_commit,
)
from user_sized import read_through as read_into_page_cache

from modelhost.bench import prompt_text
from modelhost.paths import modelhost_home

SYNTH = Path("/tmp/synth-models")
DEFAULT_FILES = (SYNTH / "1b-q4_k_m.gguf", SYNTH / "3b-q4_k_m.gguf")
LLAMA_SERVER_BUILT = Path(
    "/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
)
SERVERS = ("modelhost", "modelhost-no-spare", "modelhost-no-fork", "llama-server")
KINDS = ("switch", "return", "resident", "quiet")
QUIET_S = 5.0  # before the quiet request: whatever a switch left running has ended
PHASES = ("drain_ms", "spare_wait_ms", "python_ms", "imports_ms", "weights_ms", "engine_ms",
          "listen_ms", "rest_ms")  # fmt: skip
LOG_TIME = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\[models\] (\S+) (draining|released)"
)
# llama-server's log: `M.SS.mmm.uuu` since its process started; a child's lines are `[port] `
# and its own clock. What a switch passes through, in the router's log and its new child's.
LLAMA_TIME = re.compile(r"^(?:\[(\d+)\] )?(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) \w (.*)$")
LLAMA_EVENTS = {
    "evicting": re.compile(r"evicting idle LRU name=(\S+)"),
    "exited": re.compile(r"run: instance name=(\S+) exited"),
    "spawning": re.compile(r"load: spawning server instance with name=(\S+) on port (\d+)"),
    "proxying": re.compile(r"proxying request to model (\S+) on port (\d+)"),
    "loading": re.compile(r"load_model: loading model"),
    "loaded": re.compile(r"llama_server: model loaded"),
    "prompt_eval": re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens"),
}
LLAMA_PHASES = ("drain_ms", "spawn_ms", "load_ms", "listen_ms", "prefill_ms", "rest_ms")
# One retry of a request whose connection was closed before any answer this soon after it was
# sent: a connection the server closed as it was reused (the request never reached a model).
STALE_CONNECTION_S = 1.0


def ensure_file(path: Path) -> None:
    """The synthetic file, written when missing (temporary name, then renamed)."""
    if path.exists():
        return
    shape = path.name.split("-")[0]
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.gguf")
    script = Path(__file__).with_name("synthetic_gguf.py")
    command = [sys.executable, str(script), "--shape", shape, "--type", "Q4_K_M"]
    subprocess.run([*command, "-o", str(partial)], check=True, stdout=subprocess.DEVNULL)
    partial.rename(path)


def stream_completion(
    client: httpx.Client, url: str, model: str, prompt: str, tokens: int
) -> dict[str, Any]:
    """`one_completion`, sent again once if the server closed the connection before answering
    at once (a reused connection it had closed: the request reached no model); the row says so."""
    try:
        return one_completion(client, url, model, prompt, tokens)
    except httpx.RemoteProtocolError as exc:
        if getattr(exc, "elapsed_s", STALE_CONNECTION_S) >= STALE_CONNECTION_S:
            raise
    row = one_completion(client, url, model, prompt, tokens)
    row["retried"] = True
    return row


def one_completion(
    client: httpx.Client, url: str, model: str, prompt: str, tokens: int
) -> dict[str, Any]:
    """One streamed text completion: seconds to its first text and to its end, and what the
    server said of its prompt (usage, llama-server's timings)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.read()[:300]!r}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                frame = json.loads(line[len("data: ") :])
                if "error" in frame:
                    raise RuntimeError(f"error frame: {frame['error']}")
                choices = frame.get("choices") or []
                if first is None and any(c.get("text") for c in choices):
                    first = time.perf_counter() - started
                usage = frame.get("usage") or usage
                timings = frame.get("timings") or timings
    except httpx.TransportError as exc:  # which request, and how long after it was sent
        elapsed = time.perf_counter() - started
        failed = type(exc)(f"{exc} ({model}, {elapsed:.2f} s after it was sent)")
        failed.elapsed_s = elapsed  # type: ignore[attr-defined]
        raise failed from exc
    total = time.perf_counter() - started
    row: dict[str, Any] = {"first_token_s": first if first is not None else total, "total_s": total}
    if usage is not None:
        row["prompt_tokens"] = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        row["cached_tokens"] = details.get("cached_tokens")
    if timings is not None:
        row["cache_n"], row["prompt_n"] = timings.get("cache_n"), timings.get("prompt_n")
        row.setdefault("cached_tokens", timings.get("cache_n"))
    return row


def server_argv(name: str, files: list[Path], port: int, args: argparse.Namespace) -> list[str]:
    if name.startswith("modelhost"):
        argv = [sys.executable, "-m", "modelhost", "serve", *map(str, files), "--port", str(port)]
        argv += ["--model-budget", str(args.model_budget), "--hold", "0", "--log-level", "info"]
        if name == "modelhost-no-spare":
            argv.append("--no-spare-worker")
        if name == "modelhost-no-fork":
            argv.append("--no-fork-server")
        return [*argv, *shlex.split(args.modelhost_args)]
    return [
        str(args.llama_server), "--models-dir", str(args.models_dir), "--models-max", "1",
        *LLAMA_SERVER_ARGS, "--host", "127.0.0.1", "--port", str(port),
        *shlex.split(args.llama_args),
    ]  # fmt: skip


def wait_listening(tree: ServerTree, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not tree.alive():
            raise RuntimeError(f"the server exited:\n{tree.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not listen in {timeout_s:.0f} s:\n{tree.log_tail()}")


def model_names(name: str, url: str, files: list[Path]) -> list[str]:
    """The name each server knows each file by: its stem (llama-server's router), or the
    id of modelhost's that holds the stem or is held by it."""
    if not name.startswith("modelhost"):
        return [path.stem for path in files]
    listed = [row["id"] for row in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    return [next(i for i in listed if matches(path, i)) for path in files]


def matches(path: Path, model_id: str) -> bool:
    """Whether `model_id` names the file (`1b-q4_k_m`, or `smollm2-135m-instruct` for
    SmolLM2-135M-Instruct.Q4_1.gguf)."""
    stem, model_id = path.stem.lower(), model_id.lower()
    return stem in model_id or model_id in stem


def drain_ms(log: Path, since: datetime, model: str | None) -> float | None:
    """From modelhost's log: the last drain of `model` that began after `since`, in ms."""
    began: datetime | None = None
    found: float | None = None
    for line in log.read_text(errors="replace").splitlines():
        match = LOG_TIME.match(line)
        if match is None or match.group(2) != model:
            continue
        moment = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
        if match.group(3) == "draining" and moment >= since:
            began = moment
        elif match.group(3) == "released" and began is not None:
            found = (moment - began).total_seconds() * 1000
    return found


def llama_seconds(match: re.Match[str]) -> float:
    minutes, seconds, millis, micros = (int(match.group(i)) for i in range(2, 6))
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def llama_phases(log: Path, offset: int, model: str, other: str, first_token_s: float) -> dict:
    """From llama-server's log since `offset`: where a visit that loaded `model` went (ms):
    the drain of `other` (evicting -> its instance exited), the new instance's start (spawned
    -> its model load began, on its own clock), its load (weights, context, warm-up: -> model
    loaded), listening (->
    the router proxies the request), the prefill (its prompt eval time) and the rest."""
    with open(log, "rb") as file:
        file.seek(offset)
        text = file.read().decode(errors="replace")
    router: dict[str, float] = {}
    child: dict[str, float] = {}
    port: str | None = None
    for line in text.splitlines():
        match = LLAMA_TIME.match(line)
        if match is None:
            continue
        at, message = llama_seconds(match), match.group(6)
        for event, pattern in LLAMA_EVENTS.items():
            found = pattern.search(message)
            if found is None:
                continue
            if match.group(1) is None:  # the router's own line
                name = found.group(1)
                if event in ("evicting", "exited") and name == other:
                    router.setdefault(event, at)
                elif event in ("spawning", "proxying") and name == model:
                    router.setdefault(event, at)
                    port = port or found.group(2)
            elif match.group(1) == port and event not in child:
                child[event] = float(found.group(1)) / 1e3 if event == "prompt_eval" else at
    phases: dict[str, float | None] = {p: None for p in LLAMA_PHASES}
    if "evicting" in router and "exited" in router:
        phases["drain_ms"] = (router["exited"] - router["evicting"]) * 1e3
    if "loading" in child:
        phases["spawn_ms"] = child["loading"] * 1e3
        if "loaded" in child:
            phases["load_ms"] = (child["loaded"] - child["loading"]) * 1e3
            if "spawning" in router and "proxying" in router:
                ready = router["spawning"] + child["loaded"]
                phases["listen_ms"] = max(0.0, router["proxying"] - ready) * 1e3
    if "prompt_eval" in child:
        phases["prefill_ms"] = child["prompt_eval"] * 1e3
    known = [v for v in phases.values() if v is not None]
    phases["rest_ms"] = first_token_s * 1e3 - sum(known)
    return {"phases": {k: None if v is None else round(v, 1) for k, v in phases.items()}}


def where_it_went(
    url: str, model: str, other: str, row: dict[str, Any], log: Path, asked: datetime
) -> dict[str, Any]:
    """modelhost's figures for a visit that loaded `model` (evicting `other`)."""
    view = httpx.get(f"{url}/engine", timeout=30).json()
    worker = next((w for w in view["workers"] if w["id"] == model), {})
    phases: dict[str, Any] = dict(worker.get("startup") or {})
    phases["drain_ms"] = drain_ms(log, asked.replace(microsecond=0), other)
    spent = sum(v for v in phases.values() if isinstance(v, int | float))
    phases["rest_ms"] = round(row["first_token_s"] * 1000 - spent, 1)
    return {
        "from_spare": worker.get("from_spare"),
        "forked": worker.get("forked"),
        "phases": phases,
        "spare": view.get("spare"),
    }


def run_server(
    name: str, files: list[Path], args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{name}.log"
    result: dict[str, Any] = {"argv": server_argv(name, files, port, args), "visits": []}
    print(f"{name}: starting", flush=True)
    env = dict(os.environ)
    if name.startswith("modelhost"):  # its own home: no server's KV store serves another's
        native = modelhost_home() / "cache" / "native"
        home = fresh_home(workdir / "homes", native if native.is_dir() else None)
        env["MODELHOST_HOME"] = str(home)
        if args.packed_weights == "warm":
            keep_packed_weights(files, env)
    with ServerTree(result["argv"], env, log) as tree:
        wait_listening(tree, url, args.start_timeout)
        names = model_names(name, url, files)
        result["models"] = names
        rng = random.Random(args.seed)
        last_prompt: dict[str, str] = {}
        visits = [0, 0]
        timeout = httpx.Timeout(args.request_timeout, connect=10.0)
        # A connection a request: llama-server's router closed a kept-alive connection as the
        # next request arrived on it (alternation ended there in earlier runs); on loopback a
        # new connection costs a fraction of a millisecond, for both servers alike.
        fresh = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=timeout, limits=fresh) as client:
            for step in range(2 * 2 * args.rounds + 1):  # A's first visit only warms up
                index = step % 2
                model, other = names[index], names[1 - index]
                visit = visits[index]
                visits[index] += 1
                kind = "start" if step == 0 else "return" if visit % 2 else "switch"
                prompt = (
                    last_prompt[model] if kind == "return" else prompt_text(args.prompt_tokens, rng)
                )
                last_prompt[model] = prompt
                asked, offset = datetime.now(), log.stat().st_size
                row = stream_completion(client, url, model, prompt, args.tokens)
                row.update(model=model, kind=kind, step=step)
                if name.startswith("modelhost") and kind != "start":
                    row.update(where_it_went(url, model, other, row, log, asked))
                result["visits"].append(row)
                again = stream_completion(client, url, model, prompt, args.tokens)
                again.update(model=model, kind="resident", step=step)
                result["visits"].append(again)
                if not name.startswith("modelhost") and kind != "start":
                    # Read once the next request has ended: an instance logs a request's
                    # timings after its last frame (the first ones read are the visit's own).
                    row.update(llama_phases(log, offset, model, other, row["first_token_s"]))
                print(f"  {kind:8} {model:24} first token {row['first_token_s']:7.2f} s  "
                      f"cached {row.get('cached_tokens')}  resident {again['first_token_s']:.2f} s",
                      flush=True)  # fmt: skip
            # The last resident request once more, with nothing else running (the spare warm,
            # no load): the yardstick for the resident requests made between switches.
            if name.startswith("modelhost"):
                warm_spare(url, args.start_timeout)
            time.sleep(QUIET_S)
            quiet = stream_completion(client, url, model, prompt, args.tokens)
            quiet.update(model=model, kind="quiet", step=step)
            result["visits"].append(quiet)
            print(f"  quiet    {model:24} first token {quiet['first_token_s']:7.2f} s", flush=True)
        result["peak_rss_bytes"] = tree.peak_rss
        if name == "modelhost":
            result["spare"] = warm_spare(url, args.start_timeout)
    result["summary"] = summarize(result["visits"])
    return result


def keep_packed_weights(files: list[Path], env: dict[str, str]) -> None:
    """Loads each file once in the server's home before it starts, so that every load of the
    run maps its packed weights (a server that has met these files before, on any earlier day)
    instead of the first load of each repacking them and writing them out."""
    script = (
        "import sys, threading\n"
        "from modelhost.models.loading.loader import load_model\n"
        "for path in sys.argv[1:]:\n"
        "    load_model(path)\n"
        "for name in ('packed-weights-writer', 'packed-weights-sync'):\n"
        "    for thread in threading.enumerate():\n"
        "        if thread.name == name:\n"
        "            thread.join()\n"
    )
    subprocess.run([sys.executable, "-c", script, *map(str, files)], env=env, check=True)


def warm_spare(url: str, timeout_s: float) -> dict[str, Any] | None:
    """modelhost's spare worker once warm (its RSS then), or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        spare = httpx.get(f"{url}/engine", timeout=30).json().get("spare")
        if spare is None or spare.get("state") == "ready" or time.monotonic() > deadline:
            return spare
        time.sleep(0.5)


def summarize(visits: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for kind in KINDS:
        rows = [v for v in visits if v["kind"] == kind]
        if not rows:
            continue
        entry: dict[str, Any] = {
            "count": len(rows),
            "first_token_s_median": statistics.median(v["first_token_s"] for v in rows),
        }
        cached = [v["cached_tokens"] for v in rows if v.get("cached_tokens") is not None]
        prompts = [v["prompt_tokens"] for v in rows if v.get("prompt_tokens") is not None]
        if cached:
            entry["cached_tokens_median"] = statistics.median(cached)
        if prompts:
            entry["prompt_tokens_median"] = statistics.median(prompts)
        phased = [v["phases"] for v in rows if "phases" in v]
        if phased:
            entry["phases_ms_median"] = {
                p: statistics.median(x[p] for x in phased if x.get(p) is not None)
                for p in (*PHASES, *LLAMA_PHASES)
                if any(x.get(p) is not None for x in phased)
            }
            if any("from_spare" in v for v in rows):
                entry["from_spare"] = sum(bool(v.get("from_spare")) for v in rows)
        summary[kind] = entry
    return summary


def format_table(report: dict[str, Any]) -> str:
    lines = ["server               switch s  return s  cached on return  resident s   quiet s"
             "  resident/quiet  peak RSS GB", "-" * 112]  # fmt: skip
    for name, result in report["servers"].items():
        if "error" in result and "summary" not in result:
            lines.append(f"{name:20} failed: {result['error'][:60]}")
            continue
        s = result["summary"]
        median = {
            kind: f"{s[kind]['first_token_s_median']:8.2f}" if kind in s else "       -"
            for kind in KINDS
        }
        back = s.get("return", {})
        cached = f"{back.get('cached_tokens_median', '-')}/{back.get('prompt_tokens_median', '-')}"
        peak = result.get("peak_rss_bytes", 0) / 1e9
        ratio = (s["resident"]["first_token_s_median"] / s["quiet"]["first_token_s_median"]
                 if "resident" in s and "quiet" in s else None)  # fmt: skip
        shown = f"{ratio:13.2f}x" if ratio is not None else "             -"
        lines.append(f"{name:20} {median['switch']}  {median['return']}  {cached:>16}  "
                     f"{median['resident']}  {median['quiet']}  {shown}"
                     f"    {peak:9.2f}")  # fmt: skip
    for name, result in report["servers"].items():
        for kind in ("switch", "return"):
            phases = result.get("summary", {}).get(kind, {}).get("phases_ms_median")
            if phases:
                spent = ", ".join(f"{k.removesuffix('_ms')} {v:.0f}" for k, v in phases.items())
                lines.append(f"{name} {kind}, median ms: {spent}")
        retried = sum(bool(v.get("retried")) for v in result.get("visits", []))
        if retried:
            lines.append(f"{name}: {retried} request(s) sent again on a connection closed early")
        spare = (result.get("spare") or {}).get("rss_bytes")
        if spare:
            lines.append(f"{name} spare worker RSS once warm: {spare / 1e6:.0f} MB")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*", type=Path, metavar="FILE.gguf")
    parser.add_argument("--rounds", type=int, default=2, help="switches (and returns) a model")
    parser.add_argument("--prompt-tokens", type=int, default=1200, help="words a prompt (~tokens)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens an answer (ignore_eos)")
    parser.add_argument("--model-budget", type=float, default=3.2, metavar="GB",
                        help="modelhost budget: holds one file (default 3.2, as the "
                             "measured runs had it)")  # fmt: skip
    parser.add_argument("--servers", default="modelhost,llama-server",
                        help=f"comma-separated, in order, of {', '.join(SERVERS)}")  # fmt: skip
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--modelhost-args", default="", metavar="ARGS",
                        help='added to modelhost serve: "--prompt-activations 8"')  # fmt: skip
    parser.add_argument("--llama-args", default="", metavar="ARGS")
    parser.add_argument("--packed-weights", choices=("fresh", "warm"), default="fresh",
                        help="modelhost's home starts without the files' packed weights "
                             "(fresh: the first load of each repacks it) or with them (warm: "
                             "every load maps them)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--start-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument("--request-timeout", type=float, default=900.0, metavar="S")
    parser.add_argument("--out", type=Path, default=None, metavar="FILE")
    args = parser.parse_args(argv)
    args.files = args.files or list(DEFAULT_FILES)
    if len(args.files) != 2:
        parser.error("two files: A and B")
    args.servers = [s for s in args.servers.split(",") if s]
    if unknown := [s for s in args.servers if s not in SERVERS]:
        parser.error(f"unknown servers {unknown}: {', '.join(SERVERS)}")
    if args.llama_server is None:
        found = [p for p in (LLAMA_SERVER_BUILT, *LLAMA_SERVER_CANDIDATES) if p.exists()]
        args.llama_server = found[0] if found else Path("llama-server")
    args.out = args.out or Path(f"benchmarks/results/switch-{int(time.time())}.json")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    install_cleanup()
    for path in args.files:
        ensure_file(path)
        read_into_page_cache(path)
    workdir = Path(tempfile.mkdtemp(prefix="switch-"))
    args.models_dir = workdir / "models"  # llama-server's router: both files, by their stems
    args.models_dir.mkdir()
    for path in args.files:
        (args.models_dir / path.name).symlink_to(path.resolve())
    print(f"logs under {workdir}", flush=True)
    report: dict[str, Any] = {
        "commit": git_commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "machine": {
            "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine(),
        },
        "files": [str(p) for p in args.files],
        "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "tokens": args.tokens,
        "model_budget_gb": args.model_budget,
        "packed_weights": args.packed_weights,
        "llama_server": str(args.llama_server),
        "servers": {},
    }
    try:
        for name in args.servers:
            try:
                report["servers"][name] = run_server(name, args.files, args, workdir)
            except (RuntimeError, httpx.HTTPError, StopIteration) as exc:
                report["servers"][name] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"{name} failed: {exc}", flush=True)
    except BaseException as exc:  # Ctrl-C, SIGTERM: the JSON says the run was cut short
        report["aborted"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
        print(format_table(report), flush=True)
        print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
