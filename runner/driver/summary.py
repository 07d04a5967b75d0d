"""The job's summary: `summary.json` (every figure) and `summary.txt` (the table the job prints).

Contract: `summarize(head, n_items, table, slots, metrics, resumed, interrupted, timing, plan)` is
the summary dict, `summary_text(summary, metrics, plan, table)` its text; `runner.driver.job` writes both
into the job's store and prints the text. `head` names the job (job, model, source,
compile_mode); `table` is results.parquet's rows of this input; `slots` the dispatcher's worker
slots; `metrics` the workers' `metrics()` that came back; `timing` the run's figures (startup_s,
generate_s, span_s, driver_cpu_s, driver_startup_cpu_s, shards, and all_ready_s /
steady_items_per_s when every worker served; aborted, skipped_empty). Every time "at X s" is
seconds since the job started (`JobRun`'s start, after the input checks), the clock of the log's
"worker k: ready at X s". A row is ok, failed, suspect (made by a worker after its last good
canary, before one that failed: `canary_failures` names each such worker, its node and GPU), or
not run: never generated, or `changed` (its old output removed, its regeneration not run).
Failures are grouped by cause (`results.group_errors`). `work_after` is the steady-rate rule (see
its docstring). `canary_s` and `canary_share`: the workers' seconds in canaries after the first,
and their share of the workers' serving time.

Times run from the driver's start of the run (`JobRun`: after the config, prompt checks and resume
plan, before the pool and Ray start) to the dispatch loop's end (the last rows in): `startup_s` to
the first worker ready, `generate_s` from then, `span_s` both (start-up included); `items_per_s`
is over `generate_s`, `span_items_per_s` over `span_s`. `driver_cpu_s`: the driver process's CPU
seconds (user+sys, every thread) over `span_s`, `driver_startup_cpu_s` its part in `startup_s`
(starting Ray and the pool); `shards`: shards handed to workers (retries and split shards
included).
"""

from __future__ import annotations

import json
import textwrap

from ..io.outputs import format_table, plural
from .results import format_errors, group_errors

MAX_IDS = 10    # ids listed per failure cause (summary.txt, summary.json's error_ids)
# Printed under the per-worker table: the clock of "at X s", the columns' units and what
# steady_it_s measures.
LEGEND = ("\"ready at X s\", \"all ready at\": seconds since the job started (after the input "
          "checks; Ray's start and each worker's model load and warm-up included), the clock of "
          "the log's \"worker k: ready at X s\". model_load_s, warmup_s: seconds to load the model / to compile (or load the compile cache) "
          "and warm up; steady_it_s: denoising steps/s, from the end of step 1 of each call (its "
          "one-off costs excluded); e2e_mean_s, e2e_p95_s: seconds per call (one batch), from its "
          "start to its last file written, mean / 95th percentile; peak_mem_gb: peak GPU memory while "
          "serving, GiB; startup_peak_mem_gb: before it (model load, adapters, FP8, compile). Over the serving window (first call to last batch): busy_fraction: share the "
          "model thread was generating (not waiting for work); gpu_util: NVML's utilisation, what "
          "nvidia-smi shows (it falls when the GPU idles). gpu_ms_text, gpu_ms_denoise, "
          "gpu_ms_decode: GPU milliseconds per item of text encoding (a shard's prompts in one "
          "call), denoising and VAE decoding, from CUDA events around each (GPU figures null on "
          "CPU). Seconds per stage: summed per worker; encoding and writing overlap with "
          "generating.")
# under the table when the legend is not shown (summary.txt always has it)
LEGEND_POINTER = "(the columns: summary.txt's legend, or python -m runner --explain)"
COLUMNS = ["rank", "host", "items", "failed", "restarts", "model_load_s", "warmup_s", "steady_it_s",
           "e2e_mean_s", "e2e_p95_s", "peak_mem_gb", "busy_fraction", "gpu_util", "gpu_ms_text",
           "gpu_ms_denoise", "gpu_ms_decode"]


def json_text(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"


def work_after(rows: list[dict], t_from: float) -> float:
    """Items' worth of work in one shard's `rows` done after `t_from` (epoch seconds): each ok row
    ran from `started_at` (epoch, its batch's call start) for `e2e_s` seconds; a row that started
    before `t_from` counts by the share of its run after it. (The pipelined worker overlaps a
    batch's writing with the next batch's generation, so the runs cannot be laid end to end back
    from the shard's arrival: that undercounted the first shards.) Failed rows count 0."""
    credit = 0.0
    for r in rows:
        start, dur = r.get("started_at"), r.get("e2e_s")
        if r.get("status") != "ok" or start is None or not dur:
            continue
        credit += min(1.0, max(0.0, (start + dur - t_from) / dur))
    return credit


def worker_detail(m: dict) -> dict:
    """A worker's line of the summary: its metrics' headline figures, GPU ms per item flattened."""
    d = {k: m.get(k) for k in ("rank", "host", "node_id", "gpu_name", "items", "failed", "restarts",
                                "model_load_s", "warmup_s", "steady_it_s", "e2e_mean_s", "e2e_p95_s",
                                "peak_mem_gb", "startup_peak_mem_gb", "busy_fraction", "gpu_util",
                                "serving_s", "time_s",
                                "stopped")}
    ms = m.get("gpu_ms_per_item") or {}
    d.update(gpu_ms_text=ms.get("text_encode"), gpu_ms_denoise=ms.get("denoise"),
             gpu_ms_decode=ms.get("decode"))
    return d


def served(slots, metrics) -> int:
    """Worker slots that became ready (also when interrupted before their metrics came back)."""
    return len({s.rank for s in slots if s.ready_info is not None} | {m["rank"] for m in metrics})


def not_ready(slots, metrics, now: float) -> list[dict]:
    """Worker slots that never became ready and gave no metrics: still starting when the last item
    finished (or when the job stopped). Listed, not left out: the summary must account for every
    worker asked for. `now` on the slots' clock."""
    served = {m["rank"] for m in metrics}
    return [dict(rank=s.rank, restarts=s.restarts, starting_s=round(now - s.started, 1),
                 last_error=s.last_error)
            for s in slots if s.ready_info is None and s.rank not in served]


def not_ready_text(w: dict) -> str:
    """Why a worker of `workers_not_ready` served nothing (summary.txt, report.html)."""
    why = (f"given up: {w['last_error'].splitlines()[0][:200]}" if w.get("last_error")
           else f"still starting after {w['starting_s']:.0f} s")
    if w.get("restarts"):
        return f"its replacement no. {w['restarts']}: {why}"
    return f"{why}; served nothing"


def summarize(head: dict, n_items: int, table: list[dict], slots, metrics: list[dict],
              resumed: int, interrupted: bool, timing: dict, plan, now: float) -> dict:
    """Every figure of the run (summary.json). `now`: the end, on the slots' clock."""
    ok = sum(r["status"] == "ok" for r in table)
    groups = group_errors(failed_rows(table))
    failed = sum(len(ids) for _, ids in groups)
    suspect = [r["id"] for r in table if r["status"] == "suspect"]
    gen_s = timing["generate_s"]
    canary_s = sum(m.get("canary_s") or 0.0 for m in metrics)
    serving_s = sum(m.get("serving_s") or 0.0 for m in metrics)
    return dict(
        **head, workers=served(slots, metrics), items=n_items, ok=ok, failed=failed,
        suspect=len(suspect), suspect_ids=suspect[:MAX_IDS],
        not_run=n_items - ok - failed - len(suspect), resumed=resumed,
        canary_s=canary_s, canary_share=canary_s / serving_s if serving_s else None,
        changed_not_run=sum(r["status"] == "changed" for r in table),
        worker_restarts=sum(s.restarts for s in slots), interrupted=interrupted,
        errors={cause: len(ids) for cause, ids in groups},        # by cause, largest first
        error_ids={cause: ids[:MAX_IDS] for cause, ids in groups},
        **timing,
        regenerated=len(plan.changed),          # rows whose parameters had changed
        not_in_input=len(plan.gone),            # outputs kept of ids no longer in the input
        not_in_input_ids=plan.gone,
        items_per_s=(ok - resumed) / gen_s if gen_s else None,
        span_items_per_s=(ok - resumed) / timing["span_s"] if timing["span_s"] else None,
        steps_per_s=sum(m["steps"] for m in metrics) / gen_s if gen_s else None,
        workers_detail=[worker_detail(m) for m in metrics],
        workers_not_ready=not_ready(slots, metrics, now),
    )


def canary_lines(s: dict) -> list[str]:
    """Each failed canary: the worker, where it ran (host, node, GPU), what differed and the
    outputs marked suspect (summary.txt, report.html)."""
    from ..serve.canary import where
    lines = []
    for f in s.get("canary_failures") or ():
        ids = ", ".join(f["suspect_ids"]) + (" ..." if f["suspect"] > len(f["suspect_ids"]) else "")
        lines.append(f"SUSPECT: worker {f['rank']} ({where(f['device'])}) failed its canary at "
                     f"{f['at_s']:.1f} s ({f['verdict']}); it was stopped, and the "
                     f"{plural(f['suspect'], 'output')} it made since its last good canary "
                     f"{'is' if f['suspect'] == 1 else 'are'} marked suspect"
                     + (f": {ids}" if ids else "") + "; a rerun regenerates them")
    return lines


def hang_lines(s: dict) -> list[str]:
    """Each worker declared hung: where it ran (host, node, GPU), how long it was silent, on
    which rows (summary.txt, report.html)."""
    from ..serve.canary import where
    lines = []
    for h in s.get("hangs") or ():
        ids = ", ".join(h["ids"]) + (" ..." if h["rows"] > len(h["ids"]) else "")
        lines.append(f"HUNG: worker {h['rank']} ({where(h['device'])}) made no progress for "
                     f"{h['silent_s']:.0f} s (bound {h['bound_s']:.0f} s) at {h['at_s']:.1f} s, "
                     + (f"generating {ids}" if ids else "running its canary")
                     + "; it was stopped and replaced")
    return lines


def loss_lines(s: dict) -> list[str]:
    """The workers lost during the run, one line each: when, which node, why, whether it was
    charged against ray.max_worker_restarts (a node's loss never is), how many rows went back;
    and the worker-seconds an elastic pool's workers spent ready without work."""
    lines = []
    for x in s.get("losses") or ():
        where = f" on node {x['node'][:12]}" if x.get("node") else ""
        gpu = f" ({x['gpu']})" if x.get("gpu") else ""
        lines.append(f"LOST: worker {x['rank']}{where}{gpu} at {x.get('at_s', 0):.1f} s, "
                     f"{x['kind']}: {x['cause']}; {x['rows_back']} row"
                     f"{'s' * (x['rows_back'] != 1)} back to the queue; "
                     + ("charged to ray.max_worker_restarts" if x["charged"] else "not charged"))
    if (s.get("idle_worker_s") or 0) >= 1:
        lines.append(f"idle: {s['idle_worker_s']:.0f} worker-seconds ready without work (stopped "
                     f"once the queue ran dry)")
    return lines


def wrapped(lines: list[str]) -> list[str]:
    """`lines` filled to `WIDTH` columns, continuations indented: for lines that name no row id
    (a LOST line names a node, its GPU and the cause; nothing greps them by id)."""
    return [textwrap.fill(line, WIDTH, subsequent_indent="  ") for line in lines]


def int8_fallback_lines(s: dict) -> list[str]:
    """Outputs of this directory made without int8-attention's kernel (their workers could not
    run it), in one line: how many, which workers of this run fell back and why (summary.txt);
    none when there are none (workers that fell back but made nothing are in summary.json)."""
    f = s.get("int8_fallback")
    if not f or not f["outputs"]:
        return []
    who = "; ".join(f"worker {rank}: {why}" for rank, why in sorted(f["workers"].items()))
    return [f"int8-attention: {plural(f['outputs'], 'output')} made without its kernel ("
            + (who or "by an earlier run") + f"), recorded under settings {f['settings']} (the "
            f"job's without it); a rerun where the kernel runs remakes them"]


def failed_rows(table: list[dict]) -> list[dict]:
    """The rows that failed (a `changed` row not regenerated is not run, not failed)."""
    return [r for r in table if r["status"] == "failed"]


WIDTH = 100     # the summary's columns: a terminal's width, and a file read in one


# counts whose total the summary's head gives: a column of zeros says nothing more
ZERO_IS_EMPTY = ("failed", "restarts")


def present(rows: list[dict], columns: list[str]) -> list[str]:
    """`columns` less those without a value in any row (the GPU figures of CPU workers) and the
    `ZERO_IS_EMPTY` counts that are 0 in every row."""
    return [c for c in columns
            if any(r.get(c) not in ((None, 0) if c in ZERO_IS_EMPTY else (None,)) for r in rows)]


def workers_text(workers: list[dict]) -> str:
    """The per-worker table; workers of more than one GPU type (or GPUs and CPUs) in one table
    per type, each headed by the type, so that one type's figures compare with each other."""
    stopped = ["stopped"] if any(w.get("stopped") for w in workers) else []
    groups: dict[str, list[dict]] = {}
    for w in workers:
        groups.setdefault(w.get("gpu_name") or "CPU", []).append(w)
    if len(groups) <= 1:
        return format_table(workers, present(workers, COLUMNS + stopped), WIDTH)
    return "\n\n".join(
        f"{name}: {plural(len(ws), 'worker')}, {plural(sum(w.get('items') or 0 for w in ws), 'item')}"
        f"\n{format_table(ws, present(ws, COLUMNS + stopped), WIDTH)}"
        for name, ws in sorted(groups.items()))


def head_text(s: dict) -> str:
    """The summary's first lines: outcome, model, workers and rates."""
    rate = f"{s['items_per_s']:.3g} items/s" if s["items_per_s"] else "-"
    suspect = f", {s['suspect']} suspect" if s.get("suspect") else ""
    lines = [f"job {s['job']}: {s['ok']}/{s['items']} ok, {s['failed']} failed{suspect}, "
             f"{s['not_run']} not run ({s['resumed']} done by an earlier run)"
             f"{', INTERRUPTED' if s['interrupted'] else ''}",
             f"model {s['model']} ({s['source']}), compile {s['compile_mode']}",
             f"{plural(s['workers'], 'worker')} ({plural(s['worker_restarts'], 'restart')}), first "
             f"ready at {s['startup_s']:.1f} s; generated in {s['generate_s']:.1f} s = {rate}"]
    if "steady_items_per_s" in s:
        lines.append(f"all ready at {s['all_ready_s']:.1f} s, then "
                     f"{s['steady_items_per_s']:.3g} items/s")
    return "\n".join(wrapped(lines))


def summary_text(s: dict, metrics: list[dict], plan, table: list[dict],
                 legend: bool = True) -> str:
    """summary.txt (`legend`: the table's legend under it; without: a line saying where it
    is). Its head and tables fit `WIDTH` columns; a failure, suspect or hang line is one line
    each, whatever its width (grepped for by id)."""
    under = textwrap.fill(LEGEND, WIDTH) if legend else LEGEND_POINTER
    text = f"{head_text(s)}\n\n{workers_text(s['workers_detail'])}\n{under}\n"
    for w in s.get("workers_not_ready") or ():
        text += f"worker {w['rank']}: not ready when the job ended ({not_ready_text(w)})\n"
    if metrics:   # where each worker's serving seconds went
        stages = list(metrics[0]["time_s"])
        text += "\nseconds per stage:\n" + format_table(
            [{"rank": m["rank"], **m["time_s"]} for m in metrics], ["rank", *stages], WIDTH) + "\n"
    if plan.gone:
        text += (f"\n{plural(len(plan.gone), 'output')} of ids no longer in the input (kept): "
                 f"{', '.join(plan.gone)}\n")
    if s.get("changed_not_run"):
        text += (f"\n{plural(s['changed_not_run'], 'row')} changed since their outputs were made: the old "
                 f"outputs were removed, their regeneration did not run (not run above)\n")
    if s.get("skipped_empty"):
        text += f"\n{plural(s['skipped_empty'], 'row')} with an empty prompt skipped (prompts.on_empty=skip)\n"
    if s.get("unrecorded_media"):
        text += (f"\n{plural(s['unrecorded_media'], 'file')} in media/ were written after the last record "
                 f"update (the workers' item counts include them): a rerun regenerates them\n")
    if s.get("aborted"):
        text += f"\nSTOPPED before the end: {s['aborted']}\n"
    text += "".join(f"\n{line}\n" for line in canary_lines(s) + hang_lines(s))
    text += "".join(f"\n{line}\n" for line in wrapped(loss_lines(s) + int8_fallback_lines(s)))
    failures = format_errors(group_errors(failed_rows(table)), MAX_IDS)
    if failures:   # last: what the user acts on (the console's last lines)
        text += ("\nfailures by cause (a rerun retries them):\n"
                 + "\n".join(f"  {line}" for line in failures) + "\n")
    return text
