"""Every generated block of the docs, each rendered from its results file by its script's own render function.

    python benchmarks/doc_tables.py            # rewrite every block from benchmarks/results/ (measures nothing)
    python benchmarks/doc_tables.py --check    # exit 1 and name each block whose text is not its results file's

A block is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` (doc_blocks.py); tests/
test_doc_tables.py holds each to what its render gives now, so a number in a generated table always comes from a
results file. Rerun the script that measures a table to change its numbers; rerun this after a change of a render.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark scripts, beside this one
from doc_blocks import footer, read_block, write_block  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PERFORMANCE, RESULTS_DOC = ROOT / "docs" / "performance.md", ROOT / "docs" / "results.md"
# The commit whose kernels a saved GPU run measured, by the run's date (gpu_check records no commit).
GPU_RUN_COMMITS = {"2026-12-04T13:36:43+00:00": "56d3820"}


@dataclass(frozen=True)
class Block:
    doc: Path
    name: str
    render: Callable[[], str]  # the block's text from its results file(s): reads, never measures
    source: str  # the files it renders from, for the message of a stale block


def _module(name: str) -> Any:
    return importlib.import_module(name)


def _json(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def gpu_block() -> str:
    check = _json("gpu-check-cuda.json")
    return _module("gpu_check_tables").markdown_report(check, GPU_RUN_COMMITS.get(check["env"]["date"], "unrecorded"))


def kernel_instructions_block() -> str:
    """Instructions per element moved, summed over each direction's loops: the earlier count → the current one; and
    the range of each main loop's own ratio."""
    now, before = _json("kernel-instructions.json"), _json("kernel-instructions-before.json")
    paths = ("one launch forward", "one launch backward", "split forward", "split backward")
    lines = [f"| variant | {' | '.join(paths)} | each main loop |", "|---|" + "---|" * (len(paths) + 1)]
    was = {(r["variant"], r["path"], r["kernel"], r["loop"]): r["per_element"] for r in before["rows"]}
    for variant in dict.fromkeys(key.split()[0] for key in now["totals"]):
        cells = []
        for path in paths:
            new, old = now["totals"][f"{variant} {path}"]["per_element"], \
                before["totals"][f"{variant} {path}"]["per_element"]
            cells.append(f"{old:.2f} → {new:.2f} ({new / old:.2f}×)")
        loops = [r["per_element"] / was[(r["variant"], r["path"], r["kernel"], r["loop"])] for r in now["rows"]
                 if r["main"] and r["variant"] == variant]
        cells.append(f"{min(loops):.2f}–{max(loops):.2f}×")
        lines.append(f"| {variant} | {' | '.join(cells)} |")
    lines += ["", footer(f"Built for {now['arch']} by Triton {now['triton']} (no GPU: PTX counted), head dim "
                         f"{now['head_dim']}, {now['tokens']} tokens, {now['dtype']}",
                         "benchmarks/kernel_instructions.py --json benchmarks/results/kernel-instructions.json",
                         "the earlier count: benchmarks/results/kernel-instructions-before.json")]
    return "\n".join(lines)


def mixing_passes_block(suffix: str = "", before_note: str = "main before issue 37's fusions") -> str:
    """MHLA's and TTT's bytes per layer training step in q-sized passes (op_traffic.py --passes), the earlier count
    → the current one, at 224 px also at batch 16, and what autograd keeps (saved_memory.py --json, where measured at
    that size), each against softmax; ``suffix``: another size's results (op-traffic-passes{suffix}.json and its
    -before), counted with the kernels run."""
    now, before = _json(f"op-traffic-passes{suffix}.json"), _json(f"op-traffic-passes{suffix}-before.json")
    batched = _json("op-traffic-passes-b16.json") if not suffix else None
    saved = _json("saved-memory.json")["variants"] if not suffix else {}
    passes, earlier, soft = now["q_sized_passes"], before["q_sized_passes"], saved.get("softmax", {})
    at_batch = f" at batch {batched['batch']} (× softmax) |" if batched else ""
    lines = [f"| variant | q-sized passes, earlier → now | × softmax |{at_batch} token-sized ops and launches | kept "
             "for backward × softmax | largest transient × softmax |",
             "|---|---|---:|" + ("---:|" if batched else "") + "---:|---:|---:|"]
    for name, value in passes.items():
        kept = saved.get(name)
        memory = (f"{kept['saved_mib'] / soft['saved_mib']:.2f}× | "
                  f"{kept['largest_transient_mib'] / soft['largest_transient_mib']:.2f}×" if kept and soft else "— | —")
        ops = now["token_sized_ops"][name]
        was = before["token_sized_ops"].get(name, ops) if suffix else ops
        wide = batched["q_sized_passes"] if batched else {}
        lines.append(f"| {name} | {earlier.get(name, value):.1f} → {value:.1f} | {value / passes['softmax']:.2f}× | "
                     + (f"{wide[name]:.1f} ({wide[name] / wide['softmax']:.2f}×) | " if batched else "")
                     + (f"{was:.0f} → {ops:.0f}" if was != ops else f"{ops:.0f}") + f" | {memory} |")
    if batched:
        commands = ["benchmarks/op_traffic.py --passes --depth 1 --batch 1 --sizes-only --json "
                    "benchmarks/results/op-traffic-passes.json",
                    f"benchmarks/op_traffic.py --passes --depth 1 --batch {batched['batch']} --sizes-only --json "
                    f"benchmarks/results/op-traffic-passes-b{batched['batch']}.json",
                    "benchmarks/saved_memory.py --depth 1 --batch 1 --json benchmarks/results/saved-memory.json"]
        how = (f"batch {now['batch']} (and {batched['batch']}), one bf16 training step on the GPU path (each Triton "
               "launch's tensor arguments counted, the kernels not run; no GPU)")
    else:
        commands = [f"benchmarks/op_traffic.py --passes --depth 1 --batch 1 --img-size {now['img_size']} --variants "
                    f"mhla --json benchmarks/results/op-traffic-passes{suffix}.json"]
        how = (f"batch {now['batch']}, one bf16 training step on the GPU path (the kernels in Triton's interpreter; "
               "no GPU)")
    lines += ["", footer(f"{now['model']} at {now['img_size']} px ({now['tokens']} tokens), {now['depth']} block, "
                         + how, commands,
                         f"the earlier count: benchmarks/results/op-traffic-passes{suffix}-before.json, {before_note}")]
    return "\n".join(lines)


def budget_block(name: str = "budget", results: str = "budget.jsonl", versus: tuple[str, ...] = ("paper",)) -> str:
    """budget.py writes its block with its plot: here into a copy of the doc, without the plot (the block only
    names the figure), through budget.py's own write_report."""
    budget = _module("budget")
    with tempfile.TemporaryDirectory() as tmp, patch.object(budget, "plot", lambda *args: None):
        doc = Path(tmp) / RESULTS_DOC.name
        shutil.copy(RESULTS_DOC, doc)
        budget.write_report(RESULTS / results, doc, name, versus)
        return read_block(doc.read_text(), name) or ""


BLOCKS = [
    Block(PERFORMANCE, "speed-cpu", lambda: _module("speed").render(_json("speed-cpu.json")), "speed-cpu.json"),
    Block(PERFORMANCE, "distill-overhead", lambda: _module("distill_overhead").render(
        _json("distill-overhead.json")["rows"]), "distill-overhead.json"),
    Block(PERFORMANCE, "kernel-instructions", kernel_instructions_block, "kernel-instructions*.json"),
    Block(PERFORMANCE, "mixing-passes", mixing_passes_block, "op-traffic-passes*.json, saved-memory.json"),
    Block(PERFORMANCE, "mixing-passes-384", lambda: mixing_passes_block(
        "-384", "MHLA's blocked form before W̃'s mixing and LePE moved into its kernels"),
        "op-traffic-passes-384*.json"),
    Block(PERFORMANCE, "proxy-targets-4097", lambda: _module("proxy_targets").render(_module("proxy_targets").read()),
          "op-traffic-passes-1024*.json, saved-memory-1024.json"),
    Block(PERFORMANCE, "gpu-h200", gpu_block, "gpu-check-cuda.json"),
    Block(RESULTS_DOC, "quickstart", lambda: _module("quickstart_results").render(_json("quickstart.json")),
          "quickstart.json"),
    Block(RESULTS_DOC, "default-recipe", lambda: _module("default_recipe").render(_json("default-recipe.json")),
          "default-recipe.json"),
    Block(RESULTS_DOC, "reproduce", lambda: _module("reproduce").render("same"),
          "reproduce.jsonl, reproduce-summary.json"),
    Block(RESULTS_DOC, "reproduce-transfer", lambda: _module("reproduce").render("transfer"),
          "reproduce.jsonl, reproduce-transfer-summary.json"),
    Block(RESULTS_DOC, "frontier", lambda: _module("frontier").render(["elu", "mhla"]), "frontier.jsonl"),
    Block(RESULTS_DOC, "budget", lambda: budget_block(versus=("paper", "b32")), "budget.jsonl"),
    Block(RESULTS_DOC, "quickstart-sweep", lambda: budget_block("quickstart-sweep", "quickstart-sweep.jsonl"),
          "quickstart-sweep.jsonl"),
    Block(RESULTS_DOC, "budget-reheaded", lambda: budget_block("budget-reheaded", "budget-reheaded.jsonl"),
          "budget-reheaded.jsonl"),
    Block(RESULTS_DOC, "quickstart-fast", lambda: budget_block("quickstart-fast", "quickstart-fast.jsonl"),
          "quickstart-fast.jsonl"),
    Block(RESULTS_DOC, "budget-hedgehog", lambda: budget_block("budget-hedgehog", "budget-hedgehog.jsonl",
                                                               ("b32", "b32-hedgehog", "b32-hedgehog-s2")),
          "budget-hedgehog.jsonl"),
    Block(RESULTS_DOC, "budget-pass5", lambda: budget_block("budget-pass5", "budget-pass5.jsonl", ("b32", "b16")),
          "budget-pass5.jsonl"),
    Block(RESULTS_DOC, "budget-spread-ttt",
          lambda: _module("budget_spread").render("ttt", ["b16", "b32"], 5, "transfer"), "budget-spread.jsonl"),
    Block(RESULTS_DOC, "budget-crop", lambda: budget_block("budget-crop", "budget-crop.jsonl", ("b32",)),
          "budget-crop.jsonl"),
    Block(RESULTS_DOC, "budget-crop-rule",
          lambda: _module("budget_rule").report(RESULTS / "budget-crop.jsonl", "b32-crop1", "b32"),
          "budget-crop.jsonl"),
    Block(RESULTS_DOC, "budget-levers", lambda: budget_block("budget-levers", "budget-levers.jsonl", ("b16",)),
          "budget-levers.jsonl"),
]


def stale() -> list[str]:
    """One line per block whose text is not what its results file renders."""
    return [f"{b.doc.relative_to(ROOT)}: the {b.name} block is not what benchmarks/results/{b.source} renders"
            for b in BLOCKS if read_block(b.doc.read_text(), b.name) != b.render()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a block is stale")
    args = parser.parse_args()
    if args.check:
        found = stale()
        print("\n".join(found) or f"all {len(BLOCKS)} generated blocks match their results files")
        return 1 if found else 0
    for block in BLOCKS:
        write_block(block.doc, block.name, block.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
