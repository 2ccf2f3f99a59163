"""An agent's session (issue 49): a ~20k-token system prompt and tool block like Claude Code's,
then turns that each append tool output and user text, against llama-server on the same GGUF.

    python benchmarks/agent_turns.py FILE.gguf [--turns 5] [--answer-tokens 64] [--rounds 1]
        [--tool-kb 76] [--gap S] [--servers modelhost,llama-server] [--llama-server PATH]
        [--switch-to MODEL] [--modelhost-args "..."] [--llama-args "..."] [--out FILE]

The session is generated deterministically: an instructions text (~5,600 characters) and 24
JSON tool schemas (--tool-kb KB of JSON in all: with the instructions ~20,000 of Gemma 3's
tokens, Claude Code's size), then --turns later turns, each an assistant tool call, its output
(~300-800 tokens: file text, test output, listings) and a line of user text. Every request is
the whole conversation so far as one text prompt (`/v1/completions`, greedy, --answer-tokens
answered with EOS ignored), rendered the same way for both servers, so both tokenize the same
text with the file's own tokenizer and the figures compare prefill and the prefix cache, not
chat templates (the chat surfaces' caching is tested in
tests/server/test_agent_session_cache.py).

For each server: the first turn's time to first token (client clock, streamed), each later
turn's, the tokens each server says came from its cache (modelhost: usage's cached_tokens;
llama-server: timings.cache_n), then the server restarted (modelhost on the same home, its
prefix KV store kept; llama-server as it is) and the last turn asked again. With --switch-to
MODEL (a model modelhost serves, e.g. smollm2-135m-instruct; modelhost only: llama-server here
serves one file), a short request goes to that model after the turns, then the last turn is
asked again ("after a switch and back"); --modelhost-args "--model-budget GB" decides whether
the session's model keeps its KV cache, gives it back or is evicted for the other. With
--rounds N the servers run alternately (the order swapped each round) and the table shows
medians. llama-server runs with one slot (`-np 1`), `-c` the session's length rounded up, the
machine's cores as threads. Writes JSON (default benchmarks/results/agent-turns-<time>.json)
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from server_tree import ServerTree, install_cleanup
from switch import one_completion

LLAMA_SERVER = Path("/work/llama-server/bin/llama-server")
SERVERS = ("modelhost", "llama-server")
TOOL_NAMES = [
    "Task", "Bash", "Glob", "Grep", "LS", "ExitPlanMode", "Read", "Edit", "MultiEdit", "Write",
    "NotebookEdit", "WebFetch", "TodoWrite", "WebSearch", "BashOutput", "KillShell",
    "ListMcpResources", "ReadMcpResource", "SlashCommand", "Skill", "AskUser", "Diff",
    "RunTests", "OpenPullRequest",
]  # fmt: skip
WORDS = [
    "file", "path", "line", "column", "match", "pattern", "directory", "command", "output",
    "error", "test", "module", "function", "class", "value", "return", "call", "argument",
    "option", "flag", "result", "status", "change", "commit", "branch", "review", "user", "agent",
    "tool", "schema", "string", "number", "boolean", "array", "object", "required", "default",
]  # fmt: skip


def sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


def instructions(rng: random.Random, chars: int = 5600) -> str:
    lines = ["You are an interactive agent that helps users with software engineering tasks."]
    while sum(len(line) + 1 for line in lines) < chars:
        lines.append(f"- {sentence(rng, rng.randint(10, 24))}")
    return "\n".join(lines)


def tool_schema(name: str, rng: random.Random, chars: int) -> dict[str, Any]:
    """One tool declaration of about `chars` characters of JSON."""
    tool: dict[str, Any] = {"name": name, "description": "", "input_schema": {}}
    properties: dict[str, Any] = {}
    description: list[str] = []
    while len(json.dumps(tool)) < chars:
        if len(properties) < 8 and rng.random() < 0.3:
            kind = rng.choice(["string", "number", "boolean", "array"])
            properties[f"{rng.choice(WORDS)}_{len(properties)}"] = {
                "type": kind,
                "description": sentence(rng, rng.randint(6, 16)),
            }
        else:
            description.append(sentence(rng, rng.randint(8, 20)))
        tool["description"] = " ".join(description)
        tool["input_schema"] = {
            "type": "object",
            "properties": properties,
            "required": list(properties)[:2],
            "additionalProperties": False,
        }
    return tool


def system_block(tool_kb: float, seed: int = 49) -> str:
    rng = random.Random(seed)
    per_tool = int(tool_kb * 1000 / len(TOOL_NAMES))
    tools = [tool_schema(name, rng, per_tool) for name in TOOL_NAMES]
    declared = "\n".join(json.dumps(tool) for tool in tools)
    return f"{instructions(rng)}\n\n# Tools\n<functions>\n{declared}\n</functions>"


def tool_output(rng: random.Random, lines: int) -> str:
    kind = rng.choice(["file", "tests", "listing"])
    if kind == "file":
        body = [
            f"{i:4}  def {rng.choice(WORDS)}_{i}(self, {rng.choice(WORDS)}): "
            f"return self.{rng.choice(WORDS)}"
            for i in range(lines)
        ]
    elif kind == "tests":
        body = [
            f"tests/test_{rng.choice(WORDS)}.py::test_{rng.choice(WORDS)}_{i} "
            + rng.choice(["PASSED", "PASSED", "FAILED"])
            for i in range(lines)
        ]
    else:
        body = [
            f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{i}.py  {rng.randint(100, 9000)} bytes"
            for i in range(lines)
        ]
    return "\n".join(body)


def session_turns(tool_kb: float, turns: int, seed: int = 7) -> list[str]:
    """The prompt of each turn: the first, then `turns` later ones each extending the last."""
    rng = random.Random(seed)
    text = f"<|system|>\n{system_block(tool_kb)}\n<|user|>\nThe build fails; find out why.\n"
    prompts = [text + "<|assistant|>\n"]
    for turn in range(turns):
        tool = rng.choice(TOOL_NAMES)
        call = json.dumps({"name": tool, "input": {"path": f"src/{rng.choice(WORDS)}_{turn}.py"}})
        text += f"<|assistant|>\n<tool_use>{call}</tool_use>\n"
        text += f"<|tool|>\n{tool_output(rng, rng.randint(20, 45))}\n"
        text += f"<|user|>\n{sentence(rng, rng.randint(8, 20))}\n"
        prompts.append(text + "<|assistant|>\n")
    return prompts


def complete(url: str, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One streamed completion (switch.py's): time to its first text, and what the server said
    of its prompt (usage, or llama-server's timings: cache_n + prompt_n)."""
    # A connection a request: nothing kept alive across a server's restart.
    with httpx.Client(timeout=3600) as client:
        row = one_completion(client, url, model, prompt, tokens)
    prompt_tokens = row.get("prompt_tokens")
    if prompt_tokens is None and row.get("prompt_n") is not None:
        prompt_tokens = (row.get("cache_n") or 0) + row["prompt_n"]
    cached = row.get("cached_tokens")
    return {
        "ttft_s": row["first_token_s"],
        "total_s": row["total_s"],
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached if cached is not None else row.get("cache_n"),
    }


def start(name: str, file: Path, port: int, home: Path, log: Path, args: argparse.Namespace):
    if name == "modelhost":
        argv = [sys.executable, "-m", "modelhost", "serve", str(file), "--port", str(port)]
        argv += shlex.split(args.modelhost_args)  # serve's --kv-hold: 300 s, as users have it
    else:
        cores = os.cpu_count() or 1
        argv = [str(args.llama_server), "-m", str(file), "--port", str(port), "-np", "1"]
        argv += ["-c", str(args.context), "-t", str(cores), *shlex.split(args.llama_args)]
    tree = ServerTree(argv, {**os.environ, "MODELHOST_HOME": str(home)}, log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if not tree.alive():
            raise SystemExit(f"{name} exited:\n{tree.log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return tree, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    tree.stop()
    raise SystemExit(f"{name} did not answer")


def model_name(url: str) -> str:
    rows = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    current = [row for row in rows if row.get("current")] or rows
    return str(current[0]["id"])


def run_session(
    name: str, file: Path, prompts: list[str], home: Path, logs: Path, args: argparse.Namespace
) -> dict[str, Any]:
    port = args.port + (0 if name == "modelhost" else 1)
    tree, url = start(name, file, port, home, logs / f"{name}-1.log", args)
    try:
        model = model_name(url)
        turns = []
        for index, prompt in enumerate(prompts):
            if index:
                time.sleep(args.gap)
            row = complete(url, model, prompt, args.answer_tokens)
            turns.append(row)
            print(
                f"  {name} turn {index + 1}: TTFT {row['ttft_s']:.2f} s, "
                f"prompt {row['prompt_tokens']}, cached {row['cached_tokens']}",
                flush=True,
            )
        switched = None
        if args.switch_to and name == "modelhost":
            other = complete(url, args.switch_to, "Say hello.", 8)
            back = complete(url, model, prompts[-1], args.answer_tokens)
            switched = {"other": other, "back": back}
            print(
                f"  {name} {args.switch_to}: TTFT {other['ttft_s']:.2f} s; back: TTFT "
                f"{back['ttft_s']:.2f} s, cached {back['cached_tokens']}",
                flush=True,
            )
    finally:
        tree.stop()
    tree, url = start(name, file, port, home, logs / f"{name}-2.log", args)
    try:
        restart = complete(url, model_name(url), prompts[-1], args.answer_tokens)
        print(
            f"  {name} after a restart: TTFT {restart['ttft_s']:.2f} s, "
            f"cached {restart['cached_tokens']}",
            flush=True,
        )
    finally:
        tree.stop()
    return {"turns": turns, "after_restart": restart, "after_switch": switched}


def summarize(rounds: list[dict[str, dict[str, Any]]], servers: list[str]) -> dict[str, Any]:
    """Medians over rounds: each turn's TTFT and cached share, and the restart's."""
    summary: dict[str, Any] = {}
    for name in servers:
        sessions = [r[name] for r in rounds]
        turns = len(sessions[0]["turns"])
        rows = []
        for t in range(turns):
            ttft = statistics.median(s["turns"][t]["ttft_s"] for s in sessions)
            row = sessions[0]["turns"][t]
            rows.append(
                {
                    "ttft_s": ttft,
                    "prompt_tokens": row["prompt_tokens"],
                    "cached_tokens": row["cached_tokens"],
                }
            )
        restart = statistics.median(s["after_restart"]["ttft_s"] for s in sessions)
        cached = sessions[0]["after_restart"]["cached_tokens"]
        summary[name] = {"turns": rows, "after_restart": {"ttft_s": restart, "cached": cached}}
        backs = [s["after_switch"]["back"] for s in sessions if s.get("after_switch")]
        if backs:
            summary[name]["after_switch"] = {
                "ttft_s": statistics.median(b["ttft_s"] for b in backs),
                "cached": backs[0]["cached_tokens"],
            }
    return summary


def format_table(summary: dict[str, Any], servers: list[str]) -> str:
    header = "| turn | prompt tokens | " + " | ".join(f"{name}: TTFT (cached)" for name in servers)
    ratio = len(servers) == 2
    header += " | ratio |" if ratio else " |"
    lines = [header, "|" + "---|" * (2 + len(servers) + ratio)]
    turns = summary[servers[0]]["turns"]
    for t in range(len(turns)):
        cells = []
        for name in servers:
            row = summary[name]["turns"][t]
            cells.append(f"{row['ttft_s']:.2f} s ({row['cached_tokens']})")
        line = f"| {t + 1} | {turns[t]['prompt_tokens']} | " + " | ".join(cells)
        if ratio:
            a, b = (summary[name]["turns"][t]["ttft_s"] for name in servers)
            line += f" | {a / b:.2f}x"
        lines.append(line + " |")
    restarts = [summary[name]["after_restart"] for name in servers]
    cells = [f"{row['ttft_s']:.2f} s ({row['cached']})" for row in restarts]
    line = f"| last again after a restart | {turns[-1]['prompt_tokens']} | " + " | ".join(cells)
    if ratio:
        a, b = (summary[name]["after_restart"]["ttft_s"] for name in servers)
        line += f" | {a / b:.2f}x"
    lines.append(line + " |")
    if any("after_switch" in summary[name] for name in servers):
        back = [summary[name].get("after_switch") for name in servers]
        cells = [f"{row['ttft_s']:.2f} s ({row['cached']})" if row else "-" for row in back]
        line = f"| last again after a switch and back | {turns[-1]['prompt_tokens']} | "
        lines.append(line + " | ".join(cells) + (" | - |" if ratio else " |"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--turns", type=int, default=5, help="turns after the first")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--tool-kb", type=float, default=104.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--gap", type=float, default=0.0,
        help="seconds between an answer and the next turn (a slow tool, a person): past "
        "serve's --kv-hold (300 s), modelhost reads the session back from its KV store",
    )  # fmt: skip
    parser.add_argument("--servers", default=",".join(SERVERS))
    parser.add_argument("--switch-to", default=None, metavar="MODEL")
    parser.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    parser.add_argument("--modelhost-args", default="")
    parser.add_argument("--llama-args", default="")
    parser.add_argument("--port", type=int, default=18491)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    install_cleanup()
    servers = [name for name in args.servers.split(",") if name]
    prompts = session_turns(args.tool_kb, args.turns)
    # llama-server's window: the session's characters bound its tokens from above.
    args.context = max(4096, -(-(len(prompts[-1]) // 2 + 4 * args.answer_tokens) // 4096) * 4096)
    scratch = Path(tempfile.mkdtemp(prefix="agent-turns-"))
    rounds: list[dict[str, dict[str, Any]]] = []
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else list(reversed(servers))
        this_round: dict[str, dict[str, Any]] = {}
        for name in order:
            home = scratch / f"home-{r}-{name}"  # a fresh home: no KV store from earlier rounds
            home.mkdir(parents=True)
            print(f"round {r + 1}: {name}", flush=True)
            this_round[name] = run_session(name, args.file, prompts, home, scratch, args)
        rounds.append(this_round)
    summary = summarize(rounds, servers)
    table = format_table(summary, servers)
    print(table)
    report = {
        "file": str(args.file),
        "servers": servers,
        "turns": args.turns,
        "answer_tokens": args.answer_tokens,
        "gap_s": args.gap,
        "switch_to": args.switch_to,
        "modelhost_args": args.modelhost_args,
        "tool_kb": args.tool_kb,
        "llama_context": args.context,
        "prompt_chars": [len(p) for p in prompts],
        "rounds": rounds,
        "summary": summary,
        "loadavg_end": os.getloadavg(),
        "table": table,
    }
    out = args.out or Path(__file__).parent / "results" / f"agent-turns-{int(time.time())}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
