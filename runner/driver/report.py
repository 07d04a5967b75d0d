"""report.html: the job directory as a page to look at and share, readable offline.

Contract:
- `write_report(job_dir, rows, summary, metrics, timeline, config_yaml)` writes
  `<job_dir>/report.html` atomically, plus its pictures under `<job_dir>/report/` (thumbnails,
  video previews, plots). Every link is relative, so the directory can be copied or served as is.
- `rows` are results rows (`results.parquet`'s columns); `summary` is summary.json's dict, or a
  partial one while the job runs (`items`, `job`, ...); `metrics` the workers' metrics dicts;
  `timeline` [(seconds since start, ok items so far, failed items so far), ...] of this run
  (None: keep the one saved in `report/timeline.json`); `config_yaml` None reads `config.yaml`.
- The gallery shows every output up to `MAX_GALLERY`; above that the first and last
  `MAX_GALLERY // 2` and every failure (up to `MAX_GALLERY` of them), and says how many are hidden.
- Thumbnails are made once per output (again only when the media file is newer), so the periodic
  rewrites while the job runs stay cheap. Images: a JPEG at most `THUMB` px; videos: an animated
  WebP (GIF if Pillow lacks WebP) of up to `PREVIEW_FRAMES` frames, linking to the mp4. While the
  job runs (`thumb_budget_s`), making them stops after that many seconds per rewrite (the rest
  say "preview pending" until the next), so the driver is never held up for long.
- Plots are matplotlib PNGs: throughput over time and each worker's time breakdown (whatever
  numeric breakdown a worker reports, see `time_breakdown`).

On an object store (`s3://`, `gs://` job directory) the page is built in a local staging directory
(`stage_dir`): a thumbnail's media file is fetched through the Store once, the thumbnail made and
kept there while the job runs, and report.html plus every new or changed file of `report/`
uploaded. The gallery's sampling bounds what is fetched. The staging directory is removed after
the job's last page (`remove_stage`).

`python -m runner.driver.report DIR` rebuilds the page of a finished job directory from its files (DIR may
be a URI).
"""

from __future__ import annotations

import errno
import hashlib
import html
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import urllib.parse

import numpy as np

from ..io.outputs import atomic_path, write_json
from .results import group_errors
from .summary import canary_lines, hang_lines, not_ready_text
from ..io.storage import Store, resolve

log = logging.getLogger("runner")
MAX_GALLERY = 200       # outputs shown in full; a larger job shows a sample (first/last, failures)
THUMB = 256             # px, longest side of a thumbnail
PREVIEW_FRAMES = 16     # frames of a video's animated preview
ASSETS = "report"       # sub-directory of the job directory for the page's pictures


def write_report(job_dir: "str | Store", rows: list[dict], summary: dict | None = None,
                 metrics: list[dict] = (), timeline: list | None = None,
                 config_yaml: str | None = None, thumb_budget_s: float | None = None) -> str:
    """Writes `<job_dir>/report.html` (see the module docstring); returns its path (URI)."""
    store = job_dir if isinstance(job_dir, Store) else resolve(job_dir)
    job_dir = store.base if store.local else stage_dir(store)
    assets = os.path.join(job_dir, ASSETS)
    os.makedirs(assets, exist_ok=True)
    if not timeline and not store.local and not os.path.exists(os.path.join(assets, "timeline.json")):
        timeline = json.loads(store.read_text(f"{ASSETS}/timeline.json") or "[]") or None
    timeline = _timeline(assets, timeline)
    if config_yaml is None:
        config_yaml = store.read_text("config.yaml")
    shown, hidden = sample_gallery(rows, MAX_GALLERY)
    deadline = None if thumb_budget_s is None else time.monotonic() + thumb_budget_s
    no_thumb: list[tuple[str, str]] = []      # (output, why) of thumbnails that could not be made
    plots = [p for p in (throughput_plot(timeline, summary or {}, os.path.join(assets, "throughput.png")),
                         workers_plot(metrics, os.path.join(assets, "workers.png"))) if p]
    page = PAGE.format(
        title=html.escape(f"{(summary or {}).get('job') or os.path.basename(os.path.abspath(job_dir))}"),
        css=CSS, header=_header(rows, summary or {}, metrics), files=_files(store),
        plots="".join(f"<figure class='plot'><img src='{ASSETS}/{os.path.basename(p)}' "
                      f"alt='{os.path.splitext(os.path.basename(p))[0]} plot'></figure>" for p in plots),
        workers=_workers_table(metrics, (summary or {}).get("workers_not_ready") or ()),
        failures=_failure_list(rows) + _line_list("Suspect outputs", canary_lines(summary or {}))
                 + _line_list("Hung workers", hang_lines(summary or {})),
        gallery="\n".join(_entry(job_dir, r, deadline, store, no_thumb) for r in shown),
        hidden=(f"<p class='note'>{hidden} of {len(rows)} outputs not shown: this page shows the "
                f"first and last {MAX_GALLERY // 2} and every failure. All of them are in "
                f"<a href='media/'>media/</a> and <code>results.parquet</code>.</p>" if hidden else ""),
        config=html.escape(config_yaml or "(no config.yaml)"))
    if no_thumb:        # one line, not one per output (a full disk gave 93 of them)
        log.warning("report: no thumbnail of %d output%s (%s: %s%s)", len(no_thumb),
                    "s" if len(no_thumb) > 1 else "", *no_thumb[0],
                    "; not tried for the rest" if no_thumb[-1][1] == _FULL else "")
    if not store.local:
        _upload(store, job_dir)
    store.write_text("report.html", page)
    return store.uri("report.html")


def stage_dir(store: Store) -> str:
    """The local directory where the report of a job on an object store is built (kept between
    rewrites while the job runs, so thumbnails are made and uploaded once; `remove_stage` once
    its last page is written)."""
    tag = hashlib.sha1(store.uri().encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"runner-report-{tag}")


def remove_stage(store: Store) -> None:
    """The staging directory of a job on an object store removed (its page is written): a driver
    host that runs job after job keeps nothing of them in its temp folder. A later rewrite
    (`python -m runner.driver.report`, a rerun) stages again, fetching its gallery's media once."""
    if not store.local:
        shutil.rmtree(stage_dir(store), ignore_errors=True)


_uploaded: dict[str, tuple] = {}    # staged file -> (size, mtime) when it was last uploaded


def _upload(store: Store, stage: str) -> None:
    for root, _, files in os.walk(os.path.join(stage, ASSETS)):
        for f in files:
            src = os.path.join(root, f)
            st = os.stat(src)
            if f.startswith(".tmp-") or _uploaded.get(src) == (st.st_size, st.st_mtime_ns):
                continue
            store.write_file_atomic(os.path.relpath(src, stage).replace(os.sep, "/"), src)
            _uploaded[src] = (st.st_size, st.st_mtime_ns)


def sample_gallery(rows: list[dict], limit: int = MAX_GALLERY) -> tuple[list[dict], int]:
    """The rows the gallery shows, in their order, and how many it leaves out: all of them up to
    `limit`; else the first and last `limit // 2` and the failures (at most `limit` of those)."""
    if len(rows) <= limit:
        return list(rows), 0
    half = limit // 2
    keep = set(range(half)) | set(range(len(rows) - half, len(rows)))
    failed = [i for i, r in enumerate(rows) if r.get("status") != "ok"]
    keep |= set(failed[:limit])
    shown = [rows[i] for i in sorted(keep)]
    return shown, len(rows) - len(shown)


def time_breakdown(m: dict) -> dict[str, float]:
    """Seconds a worker spent on what: its own `time_s` dict when it reports one (any numeric
    keys), else what the plain metrics give (load, warm-up, denoise, rest of the work, idle)."""
    if isinstance(m.get("time_s"), dict):
        return {k: float(v) for k, v in m["time_s"].items() if isinstance(v, (int, float)) and v > 0}
    busy, denoise = m.get("busy_s") or 0.0, m.get("denoise_s") or 0.0
    parts = {"model load": m.get("model_load_s"), "warm-up": m.get("warmup_s"), "denoise": denoise,
             "other work": busy - denoise if busy else None}
    if busy and m.get("busy_fraction"):          # busy_fraction = busy / time since ready
        parts["idle"] = busy / m["busy_fraction"] - busy
    return {k: float(v) for k, v in parts.items() if isinstance(v, (int, float)) and v > 0}


# ---------------------------------------------------------------------------------------- plots

def _figure(w=5.6, h=3.4):
    # Figure without pyplot: no global backend or state, safe in the driver's process. 150 dpi:
    # sharp on high-density screens; the page scales it to its column.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(w, h), dpi=150, layout="constrained")
    return fig, fig.add_subplot()


def _save(fig, path: str) -> str:
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def throughput_plot(timeline: list, summary: dict, path: str) -> str | None:
    """Items done against time since the job started, and the rate over a sliding window."""
    if len(timeline) < 1:
        return None
    t = np.array([p[0] for p in timeline], dtype=float)
    ok = np.array([p[1] for p in timeline], dtype=float)
    serving = min(summary.get("startup_s") or t[0], t[0])   # first worker ready (or first rows)
    # A start-up much longer than the serving (short jobs, tiny models) would squeeze the curve
    # into the right edge: then the axis starts just before serving, and the title says so.
    left = serving - 0.15 * (t[-1] - serving) if serving > 0.5 * t[-1] else 0.0
    if t[-1] <= left:       # every row arrived at one moment (a one-shard job): the whole run
        left = 0.0
    fig, ax = _figure()
    t0 = np.r_[0.0, t]
    ax.step(t0, np.r_[0.0, ok], where="post", color="tab:blue", lw=2, label="ok items (cumulative)")
    if len(timeline[0]) > 2 and any(p[2] for p in timeline):
        ax.step(t0, np.r_[0.0, [p[2] for p in timeline]], where="post", color="tab:red", lw=1.5,
                label="failed items (cumulative)")
    ax.set(xlabel="seconds since the job started", ylabel="items", ylim=(0, None))
    ax.grid(alpha=0.3)
    handles = ax.get_legend_handles_labels()[0]
    if t[-1] > serving:
        # Window of 1/20 of the serving span on a long job (shows the ramp while workers come up),
        # wider when there are few points (~20 arrivals per window, at most 1/4 of the span).
        ax2 = ax.twinx()
        w = (t[-1] - serving) * max(1 / 20, min(1 / 4, 20 / len(t)))
        grid = np.linspace(left, t[-1], 200)
        done = lambda x: np.r_[0.0, ok][np.searchsorted(t, x, side="right")]
        ax2.plot(grid, (done(grid) - done(grid - w)) / w, color="tab:orange", lw=1.5,
                 label=f"items/s (over {_secs(w)})")
        ax2.set(ylabel="items/s", ylim=(0, None))
        handles += ax2.get_legend_handles_labels()[0]
    for key, label, style in (("startup_s", "first worker ready", ":"),
                              ("all_ready_s", "all workers ready", "--")):
        if summary.get(key):
            handles.append(ax.axvline(summary[key], color="gray", ls=style, lw=1, label=label))
    right = t[-1] + 0.02 * (t[-1] - left)
    ax.set_xlim(left, right if right > left else left + 1.0)   # never a zero-width axis
    # Below the axes: the curves rise into the upper left, where a legend inside would sit.
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    title = "Throughput over time" + (f" (axis from {_secs(left)})" if left else "")
    ax.set_title(title, loc="left", fontsize=11)
    return _save(fig, path)


def workers_plot(metrics: list[dict], path: str) -> str | None:
    """One horizontal stacked bar per worker: seconds per part of `time_breakdown`."""
    parts = {m.get("rank", i): time_breakdown(m) for i, m in enumerate(metrics)}
    parts = {k: v for k, v in sorted(parts.items()) if v}
    if not parts:
        return None
    keys = list(dict.fromkeys(k for p in parts.values() for k in p))
    fig, ax = _figure(h=min(1.2 + 0.45 * len(parts), 12))
    colors = [f"C{i % 10}" for i in range(len(keys))]
    left = np.zeros(len(parts))
    ranks = list(parts)
    for key, color in zip(keys, colors):
        vals = np.array([parts[r].get(key, 0.0) for r in ranks])
        ax.barh(range(len(ranks)), vals, left=left, color=color, label=key, height=0.6)
        left += vals
    ax.set_yticks(range(len(ranks)), [f"worker {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_title("Where each worker's time went", loc="left", fontsize=11)
    return _save(fig, path)


# ------------------------------------------------------------------------------- thumbnails

def thumbnail(job_dir: str, row: dict, deadline: float | None = None,
              store: Store | None = None) -> str | None:
    """Relative path of the row's thumbnail (made if missing or older than its media file; None
    if it would have to be made after `deadline`, a time.monotonic()). With an object `store`,
    `job_dir` is the staging directory and the media file is fetched from the store."""
    media = row.get("output")
    if store is not None and not store.local:
        return _remote_thumbnail(job_dir, media, deadline, store, row.get("started_at")) \
            if media else None
    if not media or not os.path.isfile(os.path.join(job_dir, media)):
        return None
    video = media.endswith(".mp4")
    rel = _thumb_rel(media)
    src, dst = os.path.join(job_dir, media), os.path.join(job_dir, rel)
    if not (os.path.exists(dst) and os.path.getmtime(dst) >= os.path.getmtime(src)):
        if deadline is not None and time.monotonic() > deadline:
            return None
        (_video_preview if video else _image_thumb)(src, dst)
    return rel


def _thumb_rel(media: str) -> str:
    video = media.endswith(".mp4")
    return f"{ASSETS}/thumbs/{os.path.splitext(os.path.basename(media))[0]}.{_video_ext() if video else 'jpg'}"


def _remote_thumbnail(stage: str, media: str, deadline: float | None, store: Store,
                      made_at=None) -> str | None:
    """A staged thumbnail is reused while its output is the same one: `made_at` (the row's
    `started_at`) is kept beside it, outside the uploaded assets. An output regenerated under the
    same name (its row's inputs changed) gets a new thumbnail, never the old output's."""
    rel = _thumb_rel(media)
    dst = os.path.join(stage, rel)
    stamp = os.path.join(stage, ".made", rel)
    if os.path.exists(dst) and _read(stamp) == repr(made_at):
        return rel
    if deadline is not None and time.monotonic() > deadline:
        return None
    try:
        data = store.read_bytes(media)
    except FileNotFoundError:
        return None
    with tempfile.TemporaryDirectory(prefix="runner-thumb-") as d:
        src = os.path.join(d, os.path.basename(media))
        with open(src, "wb") as f:
            f.write(data)
        (_video_preview if media.endswith(".mp4") else _image_thumb)(src, dst)
    with atomic_path(stamp) as tmp:
        tmp.write_text(repr(made_at))
    return rel


def _video_ext() -> str:
    # Animated WebP is ~10x smaller than GIF for the same preview; Pillow's wheels have it.
    from PIL import features
    return "webp" if features.check("webp") else "gif"


def _image_thumb(src: str, dst: str) -> None:
    from PIL import Image
    with Image.open(src) as im:
        im = im.convert("RGB")
        im.thumbnail((THUMB, THUMB))
        with atomic_path(dst) as tmp:
            im.save(tmp, format="JPEG", quality=85)


def _video_preview(src: str, dst: str) -> None:
    """An animated WebP/GIF (by `dst`'s suffix) of up to PREVIEW_FRAMES frames spread over the
    video, at the mp4's fps."""
    import imageio_ffmpeg
    from PIL import Image
    reader = imageio_ffmpeg.read_frames(src)
    meta = next(reader)
    (w, h), fps = meta["size"], meta.get("fps") or 8
    frames = [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]
    step = max(1, len(frames) // PREVIEW_FRAMES)
    ims = []
    for f in frames[::step][:PREVIEW_FRAMES]:
        im = Image.fromarray(f)
        im.thumbnail((THUMB, THUMB))
        ims.append(im)
    with atomic_path(dst) as tmp:
        ims[0].save(tmp, format=dst.rsplit(".", 1)[-1].upper(), save_all=True, append_images=ims[1:],
                    loop=0, duration=int(1000 * step / fps), **({"quality": 75} if dst.endswith(".webp") else {}))


# -------------------------------------------------------------------------------------- html

_FULL = "the disk is full"     # a thumbnail that failed so: the others are not tried


def _entry(job_dir: str, r: dict, deadline: float | None, store: Store | None = None,
           no_thumb: list | None = None) -> str:
    """One gallery entry; a thumbnail that cannot be made is added to `no_thumb` (output, why)."""
    no_thumb = [] if no_thumb is None else no_thumb
    ok = r.get("status") == "ok"
    prompt = str(r.get("prompt") or "")
    short = prompt if len(prompt) <= 90 else prompt[:87] + "..."
    meta = [f"seed {r.get('seed')}", f"{r.get('width')}&times;{r.get('height')}"]
    if r.get("num_frames"):
        meta.append(f"{r['num_frames']} frames")
    if ok and r.get("e2e_s"):
        meta.append(f"{r['e2e_s']:.2g} s")
    thumb = None
    if ok and no_thumb and no_thumb[-1][1] == _FULL:
        no_thumb.append((str(r.get("output")), _FULL))
    elif ok:
        try:
            thumb = thumbnail(job_dir, r, deadline, store)
        except Exception as e:        # an unreadable file: the entry stays, without a picture
            full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
            no_thumb.append((str(r.get("output")), _FULL if full else f"{type(e).__name__}: {e}"))
    if thumb:
        pic = (f"<a href='{_url(r['output'])}'><img src='{_url(thumb)}' loading='lazy' "
               f"alt='{html.escape(r['id'], True)}'></a>")
    else:
        pic = f"<div class='nopic'>{html.escape(str(r.get('status'))) if not ok else 'preview pending'}</div>"
    video = "<span class='badge'>video</span>" if str(r.get("output") or "").endswith(".mp4") else ""
    err = "" if ok else f"<pre class='error'>{html.escape(str(r.get('error') or '?'))}</pre>"
    return (f"<figure class='item {'ok' if ok else 'failed'}' id='item-{html.escape(r['id'], True)}'>"
            f"{pic}<figcaption><div class='id'>{html.escape(r['id'])}{video}</div>"
            f"<div class='prompt' title='{html.escape(prompt, True)}'>{html.escape(short)}</div>"
            f"<div class='meta'>{' &middot; '.join(f'<span>{m}</span>' for m in meta)}</div>{err}</figcaption></figure>")


def _url(rel: str) -> str:
    return urllib.parse.quote(rel.replace(os.sep, "/"))


def _header(rows: list[dict], s: dict, metrics: list[dict]) -> str:
    ok = sum(1 for r in rows if r.get("status") == "ok")
    failed = sum(1 for r in rows if r.get("status") == "failed")   # `changed`: not run
    total = s.get("items") or len(rows)
    running = "generate_s" not in s
    state = ("running" if running else "interrupted" if s.get("interrupted")
             else "failures" if failed else "done")
    line = " &middot; ".join(html.escape(str(x)) for x in (
        s.get("model") and f"model {s['model']} ({s.get('source')})",
        s.get("compile_mode") and f"compile {s['compile_mode']}",
        time.strftime("updated %Y-%m-%d %H:%M UTC", time.gmtime())) if x)
    suspect = sum(1 for r in rows if r.get("status") == "suspect")
    stats = [("outputs ok", f"{ok} / {total}"), ("failed", failed),
             *([("suspect", suspect)] if suspect else []),
             ("not run", s.get("not_run", total - ok - failed - suspect)),
             ("workers", s.get("workers", len(metrics)) or "-")]
    if not running:
        stats += [("ready after", _secs(s.get("startup_s"))),
                  ("generating", _secs(s.get("generate_s"))),
                  ("items/s", _num(s.get("items_per_s"))),
                  ("items/s, all serving", _num(s.get("steady_items_per_s"))),
                  ("worker restarts", s.get("worker_restarts", 0))]
        if s.get("resumed"):
            stats.append(("done by an earlier run", s["resumed"]))
    cards = "".join(f"<div class='stat{' bad' if k in ('failed', 'suspect') and v else ''}'><b>{html.escape(str(v))}"
                    f"</b><span>{k}</span></div>" for k, v in stats)
    return (f"<span class='state {state}'>{state}</span><p class='sub'>{line}</p>"
            f"<div class='stats'>{cards}</div>")


def _files(store: Store) -> str:
    names = [n for n in ("summary.txt", "results.parquet", "config.yaml") if store.exists(n)]
    names += [n for n in ("records/", "metrics/", "media/")       # a "directory" of an object store
              if not store.local or os.path.isdir(store.path(n))]   # exists once it has files
    return "<p class='files'>files: " + " &middot; ".join(f"<a href='{n}'>{n}</a>" for n in names) + "</p>"


def _num(v) -> str:
    return "-" if v is None else f"{v:.3g}"


def _secs(v) -> str:
    """A duration as people read it: 4.2 s, 95 s, 12.5 min, 3.1 h."""
    if v is None:
        return "-"
    return (f"{v:.2g} s" if v < 10 else f"{v:.0f} s" if v < 120 else f"{v / 60:.1f} min" if v < 7200
            else f"{v / 3600:.1f} h")


def _workers_table(metrics: list[dict], not_ready=()) -> str:
    """The workers' figures, and the workers that were not ready when the job ended (listed, so
    that every worker asked for is accounted for)."""
    late = "".join(f"<li>worker {w['rank']}: {html.escape(not_ready_text(w))}</li>" for w in not_ready)
    late = f"<p class='note'>Not ready when the job ended:</p><ul>{late}</ul>" if late else ""
    cols = ["rank", "host", "gpu_name", "items", "failed", "restarts", "model_load_s", "warmup_s",
            "steady_it_s", "e2e_mean_s", "e2e_p95_s", "peak_mem_gb", "busy_fraction", "gpu_util",
            "gpu_ms_text", "gpu_ms_denoise", "gpu_ms_decode"]
    if not metrics:
        return f"<h2>Workers</h2>{late}" if late else ""
    # per item GPU milliseconds of each model stage (CPU workers: none)
    metrics = [{**m, **{f"gpu_ms_{k.split('_')[0]}": v
                        for k, v in (m.get("gpu_ms_per_item") or {}).items()}} for m in metrics]
    cols = [c for c in cols if any(m.get(c) is not None for m in metrics)]
    head = "".join(f"<th>{c}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(m.get(c)))}</td>" for c in cols) + "</tr>"
                   for m in sorted(metrics, key=lambda m: m.get("rank", 0)))
    return f"<h2>Workers</h2><div class='scroll'><table><tr>{head}</tr>{body}</table></div>{late}"


def _cell(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _failure_list(rows: list[dict]) -> str:
    groups = group_errors(r for r in rows if r.get("status") == "failed")   # not `changed` ones
    if not groups:
        return ""
    items = "".join(f"<li><b>{len(ids)} &times;</b> <code>{html.escape(cause)}</code>: "
                    f"{html.escape(', '.join(ids[:20]))}{' ...' if len(ids) > 20 else ''}</li>"
                    for cause, ids in groups)
    return f"<h2>Failures</h2><ul class='failures'>{items}</ul>"


def _line_list(title: str, lines: list[str]) -> str:
    """A section of the summary's lines under `title` (none: nothing): the workers whose canary
    failed (`canary_lines`: where each ran, its suspect outputs), those declared hung
    (`hang_lines`: where each ran, the rows it held)."""
    if not lines:
        return ""
    return (f"<h2>{title}</h2><ul class='failures'>"
            + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>")


def _timeline(assets: str, timeline: list | None) -> list:
    """This run's timeline, saved next to the plots so a rebuild (or a no-op rerun) keeps it."""
    path = os.path.join(assets, "timeline.json")
    if timeline:
        write_json(path, [list(p) for p in timeline])
        return list(timeline)
    return json.loads(_read(path) or "[]")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;margin:0;color:#1d2330;background:#f5f6f8}
main{max-width:1200px;margin:0 auto;padding:24px}
h1{margin:0 8px 0 0;font-size:24px;display:inline-block}
h2{font-size:17px;margin:28px 0 10px}
.sub{color:#5b6475;margin:4px 0 16px}
.state{padding:2px 10px;border-radius:10px;font-size:12px;color:#fff;vertical-align:super;background:#2f7d32}
.state.running{background:#1f6fd1}.state.failures{background:#c77700}.state.interrupted{background:#b3261e}
.stats{display:flex;flex-wrap:wrap;gap:10px}
.stat{flex:1 1 80px;background:#fff;border-radius:8px;padding:10px 12px;box-shadow:0 1px 2px #0002}
.stat b{display:block;font-size:19px;white-space:nowrap}.stat span{color:#5b6475;font-size:12px}
.stat.bad b{color:#b3261e}
.plots{display:flex;flex-wrap:wrap;gap:12px;align-items:flex-start}
.plot{flex:1 1 420px;margin:0;background:#fff;border-radius:8px;padding:8px;box-shadow:0 1px 2px #0002}
.plot img{display:block;width:100%}
.gallery{display:grid;grid-template-columns:repeat(auto-fill,minmax(180px,1fr));gap:12px}
.item{margin:0;background:#fff;border-radius:8px;overflow:hidden;box-shadow:0 1px 2px #0002}
.item img{display:block;width:100%;aspect-ratio:1;object-fit:cover;background:#ddd}
.item.failed{outline:2px solid #b3261e}
.nopic{aspect-ratio:1;display:flex;align-items:center;justify-content:center;background:#fbe9e7;color:#b3261e;font-weight:600}
figcaption{padding:6px 8px 8px}
.id{font-weight:600;font-size:12px;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.prompt{font-size:13px;display:-webkit-box;-webkit-line-clamp:2;-webkit-box-orient:vertical;overflow:hidden}
.meta{color:#5b6475;font-size:12px;margin-top:2px}.meta span{white-space:nowrap}
.badge{background:#e3e8f0;border-radius:4px;padding:0 4px;margin-left:6px;font-size:11px;font-weight:400}
.error{color:#b3261e;white-space:pre-wrap;font-size:11px;margin:4px 0 0;max-height:6em;overflow:auto}
.failures code{color:#b3261e}
.note{color:#5b6475}
.files{font-size:12px;color:#5b6475;margin:10px 0 14px}.files a{color:#1f6fd1}
table{border-collapse:collapse;background:#fff;font-size:13px}
th,td{padding:4px 10px;text-align:right;border-bottom:1px solid #e6e8ec}
th{background:#eef0f4}
.scroll{overflow-x:auto}
details{background:#fff;border-radius:8px;padding:8px 12px;margin-top:28px}
pre.config{font-size:12px;overflow:auto}
"""

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width">
<title>{title}: runner report</title><style>{css}</style></head>
<body><main>
<header><h1>{title}</h1>{header}</header>
{files}
<section class="plots">{plots}</section>
{workers}
{failures}
<h2>Outputs</h2>
{hidden}
<section class="gallery">
{gallery}
</section>
<details><summary>Resolved config</summary><pre class="config">{config}</pre></details>
</main></body></html>
"""


def main(argv: list[str]) -> int:
    """`python -m runner.driver.report DIR`: the page again from a job directory's files."""
    if len(argv) != 1:
        print("usage: python -m runner.driver.report JOB_DIR", file=sys.stderr)
        return 2
    import pyarrow.parquet as pq
    store = resolve(argv[0])
    rows = pq.read_table(store.open_input("results.parquet")).to_pylist()
    summary = json.loads(store.read_text("summary.json") or "{}")
    metrics = [json.loads(store.read_text(f"metrics/{n}")) for n in sorted(store.list("metrics"))
               if n.endswith(".json")]
    try:
        print(write_report(argv[0], rows, summary, metrics))
    finally:
        remove_stage(store)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
