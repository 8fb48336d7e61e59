"""Write the measured tables of ``docs/results.md`` from the JSON files the commands wrote.

Each table on the page sits between two marker comments naming its section::

    <!-- results_page: bench-methods -->
    ...made by this script; edits here are overwritten...
    <!-- /results_page: bench-methods -->

and is made from one command's ``--json`` output, with the cells the command itself prints
(``swap_pass.tools.bench.report``'s sections), the command, its date, machine and build. So a figure
on the page is always one a command printed, beside that command. Text outside the markers is
left as it is. Sections whose JSON is not given are left as they are.

=================  ===========================================================================
section            made from
=================  ===========================================================================
bench-methods      ``swap-pass bench --json PATH`` (``--bench``): the upper table and the anchor
bench-host         the same file: host cost per layer
smartswap          the same file: SmartSwap's rows
host-stages        ``python scripts/host_cost.py stages --json PATH`` (``--stages``)
host-instructions  ``python scripts/host_cost.py instructions --json PATH`` (``--instructions``)
graph-peaks        ``python scripts/graph_peak.py --json PATH`` (``--graph``)
gpu-stages         ``scripts/gpu_check.sh``'s ``stages.jsonl`` (``--gpu-stages``)
gpu-headline       its ``headline.json``: the bench against full recompute (``--gpu-headline``)
gpu-tools          its ``tools.json``: the fine-tuning tools' offloading (``--gpu-tools``)
tools              ``swap-pass bench --methods <the tools' rows> --json PATH`` (``--tools``)
tools-device       the same on the test accelerator (``--tools-device``)
gpu-peaks          its ``accelerator-peaks.json``: compiled forward peaks (``--gpu-peaks``)
gpu-capacity       its ``capacity.json``: capacity under a real cap (``--gpu-capacity``)
gpu-methods        ``swap-pass bench --json PATH`` on an accelerator (``--gpu-bench``)
gpu-compile        the same, its compile rows (``--gpu-compile``)
megatron           ``swap-pass bench --megatron --json PATH`` (``--megatron``)
megatron-cpu       ``python scripts/megatron_cpu_rows.py --json PATH`` (``--megatron-cpu``)
capacity-batch     ``swap-pass capacity --dim batch --json PATH`` (``--capacity-batch``)
capacity-seq       ``swap-pass capacity --dim seq --json PATH`` (``--capacity-seq``)
=================  ===========================================================================

``--gpu-check DIR`` reads the five ``gpu-*`` files above from the folder ``scripts/gpu_check.sh``
wrote (its ``$OUT``), those present; a stage that did not finish left none, and its section stays.

Usage: PYTHONPATH=<checkout> python scripts/results_page.py [--page docs/results.md]
       [--bench B.json] [--stages S.json] [--instructions I.json] [--graph G.json]
       [--gpu-check DIR] [--gpu-stages stages.jsonl] [--gpu-headline H.json] [--tools T.json]
       [--tools-device T.json] [--gpu-tools T.json]
       [--gpu-peaks P.json] [--gpu-capacity C.json] [--gpu-bench G.json] [--gpu-compile C.json]
       [--megatron M.json] [--megatron-cpu M.json] [--capacity-batch B.json]
       [--capacity-seq S.json]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from swap_pass.tools.bench.harness import MethodResult
from swap_pass.tools.bench.methods import TOOL_KEYS
from swap_pass.tools.bench.report import (
    Section,
    anchor_line,
    headline_section,
    host_section,
    method_section,
    mib,
    smart_sections,
    tools_section,
)

ROOT = Path(__file__).resolve().parents[1]


def md_table(head: list[str], body: list[list[str]]) -> list[str]:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    rule = ["---"] + ["---:"] * (len(head) - 1)
    return ["| " + " | ".join(cells) + " |" for cells in (head, rule, *body)]


def _md_section(section: Section, title: str | None = None) -> list[str]:
    return [f"**{title or section.title}**", "", *md_table(section.head, section.body), ""]


def provenance(meta: dict) -> str:
    """One line: the command, when, where, which torch and build."""
    where = ", ".join(str(meta[k]) for k in ("machine",) if meta.get(k))
    loads = [x for x in meta.get("load_avg_1m", []) if x is not None]
    load = f", load average {min(loads)}-{max(loads)}" if loads else ""
    return (f"Command: `{meta['command']}`. Measured {meta['date']}{', ' + where if where else ''}"
            f", torch {meta['torch']}, build `{meta.get('build') or 'unknown'}`{load}.")


def bench_methods(data: dict) -> list[str]:
    """The bench's upper table, its rows that did not run, and the anchor."""
    meta, preset = data["meta"], data["meta"]["preset"]
    rows = [MethodResult(**row) for row in data["rows"]]
    model = preset["model"]
    lines = [provenance(meta), "",
             f"Model: {model['num_layers']} layers, hidden {model['hidden_size']}, batch "
             f"{preset['batch']}, seq {preset['seq']}, {preset['dtype']}; compile rows with "
             f"inner `{meta['compile_inner']}`; {preset['timed_steps']} timed steps, "
             f"{meta.get('threads', '?')} intra-op thread(s).", "",
             *md_table(*_head_body(method_section(rows))), ""]
    lines += [f"- {r.label}: {r.status}: {r.reason}" for r in rows if r.status != "ok"]
    return [*lines, f"- {anchor_line(data['anchor'])}"]


def _head_body(section: Section) -> tuple[list[str], list[list[str]]]:
    return section.head, section.body


def bench_host(data: dict) -> list[str]:
    section = host_section(data.get("host", {}))
    if section is None:
        return [f"Not measured by `{data['meta']['command']}`: {data['host'].get('reason', '')}."]
    return [provenance(data["meta"]), "", *_md_section(section)]


def smartswap(data: dict) -> list[str]:
    sections = smart_sections(data.get("extra", {}))
    if not sections:
        return [f"Not measured by `{data['meta']['command']}`."]
    return [provenance(data["meta"]), "", *(line for s in sections for line in _md_section(s))]


def host_stages(data: dict) -> list[str]:
    stages = [[name, f"{us:.2f}"] for name, us in data["stages_us"].items()]
    bare = data["added_us_per_layer"]["bare"]
    added = [[name, f"{us:.1f}", f"{us / bare:.2f}x"]
             for name, us in data["added_us_per_layer"].items()]
    return [provenance(data["meta"]), "",
            f"**Stages of one layer's swap, median over {data['steps']} steps**", "",
            *md_table(["stage", "us"], stages), "",
            f"**Added per layer over no swap ({data['layers']} layers; least step CPU time)**",
            "", *md_table(["way", "us", "over bare"], added)]


def host_instructions(data: dict) -> list[str]:
    bases = sorted({base for row in data["rows"].values() for base in row.get("over", {})})
    body = [[name, f"{row['per_layer']:,.0f}", f"{row['added']:,.0f}",
             *(f"{row['over'][b]:.2f}x" if b in row.get("over", {}) else "-" for b in bases)]
            for name, row in data["rows"].items()]
    return [provenance(data["meta"]), "",
            *md_table(["method", "instructions per layer", "added over no swap",
                       *(f"over {b}" for b in bases)], body)]


def graph_peaks(data: dict) -> list[str]:
    meta = data["meta"]
    body = [[f"{r['row']}", mib(r["reference_peak_bytes"]), mib(r["peak_bytes"]),
             f"{r['peak_bytes'] / r['reference_peak_bytes']:.3f}x",
             mib(r["reference_peak_bytes"] - r["peak_bytes"]),
             f"{r['cut_layer_inputs']:.2f}" if r.get("checkpoint", True) else "-",
             "yes" if r["bitwise"] else f"no ({r['max_relative_difference']:.1e})"]
            for r in data["rows"]]
    return [provenance(meta), "",
            f"HF Llama, {meta['layers']} layers, hidden {meta['hidden']}, batch {meta['batch']}, "
            f"seq {meta['seq']}, inner `{meta['inner']}`; peak of one profiled step after a "
            "warm-up step; reference: the same compile without swap.", "",
            *md_table(["row", "peak without swap MiB", "peak with swap MiB", "ratio", "cut MiB",
                       "cut in layer inputs", "gradients bitwise"], body)]


def megatron(data: dict) -> list[str]:
    section = data.get("extra", {}).get("megatron", {})
    if section.get("status") != "ok":
        return [f"Not measured by `{data['meta']['command']}`: {section.get('reason', '')}."]
    body = [[r["method"], mib(r["peak_bytes"]), f"{r['memory_ratio']:.2f}x",
             f"{r['step_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x", mib(r["swapped_out_bytes"]),
             {True: "yes", False: "NO", None: "-"}[r.get("exact")] + f" (vs {r['exact_vs']})"]
            if r["status"] == "ok" else [r["method"], *["-"] * 5, r["status"]]
            for r in section["rows"]]
    return [provenance(data["meta"]), "",
            *md_table(["method", "peak MiB", "mem", "step ms", "time", "swapped MiB", "exact"],
                      body)]


def capacity(data: dict) -> list[str]:
    """``swap-pass capacity``'s table: the largest size per method under the cap."""
    dim, rows = data["dim"], data["rows"]
    base = next((r["max"] for r in rows if r["method"] == "no_swap" and r["max"]), None)
    body = [[r["label"], f"{r['max']:,}", f"{r['max'] / base:.1f}x" if base else "-",
             mib(r["peak_bytes"]), mib(r["planned_peak_bytes"]),
             f"{r['need_without_swap_bytes'] / data['device_memory']:.2f}x",
             mib(r["host_bytes"]), f"{r['step_ms']:,.0f}", f"{r['cpu_ms']:,.0f}",
             "-" if r["exact"] is None else f"{'yes' if r['exact'] else 'NO'} @ {r['exact_at']}"]
            for r in rows]
    cap = "virtual cap (CPU)" if data["virtual_cap"] else "real cap"
    return [provenance(data["meta"]), "",
            f"Largest {dim} per method under {mib(data['device_memory'])} MiB of device memory, "
            f"{cap}; peaks in MiB.", "",
            *md_table(["method", f"max {dim}", "x no swap", "peak", "planned peak",
                       "need w/o swap, x cap", "host", "step ms", "CPU ms", "losses = no swap"],
                      body)]


def gpu_headline(data: dict) -> list[str]:
    """The GPU check's first table: each method against full recompute and a plain copy."""
    rows = [MethodResult(**row) for row in data["rows"]]
    section = headline_section(rows, data["anchor"])
    if section is None:
        return [f"Not measured by `{data['meta']['command']}`: the full recompute row did not "
                "run."]
    preset = data["meta"]["preset"]
    model = preset["model"]
    lines = [provenance(data["meta"]), "",
             f"Model: {model['num_layers']} layers, hidden {model['hidden_size']}, batch "
             f"{preset['batch']}, seq {preset['seq']}, {preset['dtype']}; {preset['timed_steps']} "
             "timed steps; time: each row's paired step-time ratio over full recompute's.", "",
             *md_table(section.head, section.body), ""]
    lines += [f"- {r.label}: {r.status}: {r.reason}" for r in rows if r.status != "ok"]
    return [*lines, f"- {anchor_line(data['anchor'])}"]


def offload_tools(data: dict) -> list[str]:
    """The fine-tuning tools' offloading against HF checkpointing, with the rows that could not
    run and why."""
    rows = [MethodResult(**row) for row in data["rows"]]
    section = tools_section(rows)
    if section is None:
        return [f"Not measured by `{data['meta']['command']}`: the HF checkpointing row did not "
                "run."]
    preset = data["meta"]["preset"]
    model = preset["model"]
    keys = set(TOOL_KEYS)
    return [provenance(data["meta"]), "",
            f"Model: HF Llama, {model['num_layers']} layers, hidden {model['hidden_size']}, batch "
            f"{preset['batch']}, seq {preset['seq']}, {preset['dtype']}; {preset['timed_steps']} "
            "timed steps; x ckpt: ratio to HF checkpointing's (times: of the paired ratios).", "",
            *md_table(section.head, section.body), "",
            *[f"- {r.label}: {r.status}: {r.reason}" for r in rows
              if r.key in keys and r.status != "ok"]]


def gpu_stages(records: list[dict]) -> list[str]:
    """The GPU check's stages: limit, time taken, status, the files each wrote."""
    total = sum(r["limit_s"] for r in records)
    body = [[r["stage"], f"{r['limit_s']}", f"{r['seconds']}", r["status"],
             "-" if r["exit"] is None else f"{r['exit']}", ", ".join(r["files"]) or "-"]
            for r in records]
    finished = records[-1].get("finished", "?") if records else "?"
    return [f"Command: `scripts/gpu_check.sh`. Last stage finished {finished}; the stage limits "
            f"listed add up to {total} s.", "",
            *md_table(["stage", "limit s", "took s", "status", "exit", "files"], body)]


def gpu_peaks(data: dict) -> list[str]:
    """``tests/graph/test_accelerator.py``'s compiled forward peaks, allocated and reserved."""
    ref, swap, layer = data["without_swap"], data["with_swap"], data["layer_input_bytes"]
    body = [[kind, mib(ref[kind]), mib(swap[kind]), f"{(ref[kind] - swap[kind]) / layer:.2f}"]
            for kind in ("allocated", "reserved")]
    return [f"{data['test']}: {data['layers']} layers, hidden {data['hidden']}, batch "
            f"{data['batch']}, seq {data['seq']}, fp32 (`tests/graph/test_accelerator.py`).", "",
            *md_table(["peak", "without swap MiB", "with swap MiB", "cut in layer inputs"], body)]


# section -> (the option naming its JSON file, what makes its lines)
SECTIONS: dict[str, tuple[str, Callable[[dict], list[str]]]] = {
    "bench-methods": ("bench", bench_methods), "bench-host": ("bench", bench_host),
    "smartswap": ("bench", smartswap), "host-stages": ("stages", host_stages),
    "host-instructions": ("instructions", host_instructions), "graph-peaks": ("graph", graph_peaks),
    "tools": ("tools", offload_tools), "tools-device": ("tools-device", offload_tools),
    "gpu-tools": ("gpu-tools", offload_tools),
    "gpu-stages": ("gpu-stages", gpu_stages), "gpu-headline": ("gpu-headline", gpu_headline),
    "gpu-peaks": ("gpu-peaks", gpu_peaks), "gpu-capacity": ("gpu-capacity", capacity),
    "gpu-methods": ("gpu-bench", bench_methods), "gpu-compile": ("gpu-compile", bench_methods),
    "megatron": ("megatron", megatron), "megatron-cpu": ("megatron-cpu", megatron),
    "capacity-batch": ("capacity-batch", capacity), "capacity-seq": ("capacity-seq", capacity),
}


def _markers(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- results_page: {name} -->\n).*?(<!-- /results_page: {name} -->)",
                      re.DOTALL)


def regenerate(page: str, files: dict[str, dict]) -> str:
    """``page`` with every section whose JSON is in ``files`` (by option name) made again."""
    for name, (option, make) in SECTIONS.items():
        if option not in files:
            continue
        pattern = _markers(name)
        if pattern.search(page) is None:
            raise SystemExit(f"results_page.py: the page has no section {name!r}; it needs the "
                             f"markers <!-- results_page: {name} --> and "
                             f"<!-- /results_page: {name} -->.")
        text = "\n".join(make(files[option])) + "\n"
        page = pattern.sub(lambda m, text=text: m.group(1) + text + m.group(2), page)
    return page


# the files scripts/gpu_check.sh writes under its $OUT, by option
GPU_CHECK_FILES = {"gpu-stages": "stages.jsonl", "gpu-headline": "headline.json",
                   "gpu-tools": "tools.json",
                   "gpu-peaks": "accelerator-peaks.json", "gpu-capacity": "capacity.json"}


def load(path: Path) -> dict | list[dict]:
    """A JSON file, or a JSON-lines file (``.jsonl``) as a list of its records."""
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)


def gpu_check_files(folder: Path) -> dict[str, Path]:
    """The ``gpu-*`` options' files found in ``scripts/gpu_check.sh``'s output folder."""
    if not folder.is_dir():
        raise SystemExit(f"results_page.py: --gpu-check {folder} is not a folder. It must be the "
                         "folder scripts/gpu_check.sh wrote ($OUT).")
    return {o: folder / name for o, name in GPU_CHECK_FILES.items() if (folder / name).is_file()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", default=str(ROOT / "docs" / "results.md"))
    parser.add_argument("--gpu-check", type=Path,
                        help="scripts/gpu_check.sh's output folder: its gpu-* files")
    for option in sorted({option for option, _ in SECTIONS.values()}):
        parser.add_argument(f"--{option}", type=Path, help="its command's JSON file")
    args = parser.parse_args(argv)
    given = {o: getattr(args, o.replace("-", "_")) for o, _ in SECTIONS.values()}
    if args.gpu_check is not None:
        given.update(gpu_check_files(args.gpu_check))
    files = {o: load(path) for o, path in given.items() if path is not None}
    if not files:
        options = ", ".join(f"--{o}" for o in dict.fromkeys(o for o, _ in SECTIONS.values()))
        sys.exit(f"results_page.py: give at least one JSON file ({options}).")
    page = Path(args.page)
    page.write_text(regenerate(page.read_text(), files))


if __name__ == "__main__":
    main()
