"""A GPU that joins mid-job (issue 74's real-GPU check): a local Ray head with no GPU, the job
started against it with `ray.min_workers=1` (it asks for a GPU and waits: "waiting for GPUs"), then,
`join_s` seconds later, a second Ray node on the same machine with the GPU. The job must place a
worker there and generate on it; the record says when the node joined, when its worker was ready,
which GPU made the rows, and what the job printed while it waited.

    python -m runner.bench.elastic_gpu OUT [job=sd2_batch] [join_s=20] [rows=8] [steps=20]

Writes OUT/elastic.json and OUT/job.log; exit 0 only when every row is ok and was made on a GPU.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

RAY = [sys.executable, "-m", "ray.scripts.scripts"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str]) -> int:
    out, opts = argv[0], dict(a.split("=", 1) for a in argv[1:])
    job, join_s = opts.get("job", "sd2_batch"), float(opts.get("join_s", 20))
    rows, steps = int(opts.get("rows", 8)), int(opts.get("steps", 20))
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    temp, port = tempfile.mkdtemp(prefix="eg-", dir="/tmp"), _port()
    common = [f"--temp-dir={temp}", "--disable-usage-stats", "--num-cpus=4"]
    subprocess.run([*RAY, "start", "--head", f"--port={port}", "--num-gpus=0",
                    "--include-dashboard=false", *common], env=env, check=True,
                   capture_output=True)
    import pyarrow as pa
    import pyarrow.parquet as pq
    prompts = os.path.join(out, "prompts.parquet")
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(rows)],
                             "prompt": [f"a photo of a lighthouse, variant {i}" for i in range(rows)],
                             "seed": list(range(rows))}), prompts)
    args = [sys.executable, "-m", "runner", f"job={job}", "model.source=random",
            f"prompts.path={prompts}", f"output.dir={out}", "job.name=elastic",
            f"ray.address=127.0.0.1:{port}", "ray.min_workers=1", "ray.gpu_wait_s=300",
            f"generation.num_inference_steps={steps}", "output.overwrite=true"]
    t0 = time.time()
    with open(os.path.join(out, "job.log"), "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        time.sleep(join_s)
        t_join = time.time()
        subprocess.run([*RAY, "start", f"--address=127.0.0.1:{port}", "--num-gpus=1", *common],
                       env=env, check=True, capture_output=True)
        t_joined = time.time()
        try:
            status = proc.wait(timeout=540 - join_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            status = "timeout"
    t_end = time.time()
    subprocess.run([*RAY, "stop", "--force"], env=env, capture_output=True)
    text = open(os.path.join(out, "job.log")).read()
    job_dir = os.path.join(out, "elastic")
    table = pq.read_table(os.path.join(job_dir, "results.parquet")).to_pylist() \
        if os.path.exists(os.path.join(job_dir, "results.parquet")) else []
    metrics = [json.load(open(os.path.join(job_dir, "metrics", f)))
               for f in sorted(os.listdir(os.path.join(job_dir, "metrics")))] \
        if os.path.isdir(os.path.join(job_dir, "metrics")) else []
    summary = json.load(open(os.path.join(job_dir, "summary.json"))) \
        if os.path.exists(os.path.join(job_dir, "summary.json")) else {}
    ready = [float(x.split("ready at ")[1].split(" s")[0]) for x in text.splitlines()
             if ": ready at " in x]
    record = dict(job=job, rows=rows, steps=steps, status=status, join_s=round(t_join - t0, 1),
                  node_up_s=round(t_joined - t0, 1), end_s=round(t_end - t0, 1),
                  worker_ready_s=ready, ok=sum(r["status"] == "ok" for r in table),
                  waiting_lines=[x for x in text.splitlines() if "waiting for GPUs" in x][:3],
                  gpus=sorted({m.get("gpu_name") or "?" for m in metrics}),
                  devices=sorted({str(m.get("device")) for m in metrics}),
                  images_per_s=summary.get("steady_items_per_s") or summary.get("items_per_s"),
                  peak_gb=[m.get("peak_mem_gb") for m in metrics])
    json.dump(record, open(os.path.join(out, "elastic.json"), "w"), indent=1)
    print(json.dumps(record, indent=1))
    on_gpu = record["gpus"] and all("cpu" not in g.lower() and g != "?" for g in record["gpus"])
    return 0 if status == 0 and record["ok"] == rows and on_gpu and record["waiting_lines"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
