#!/usr/bin/env bash
# The GPU checks (docs/gpu.md records their figures): CUDA tests, learner benches on real model shapes,
# the actor bench on CUDA, and a whole run with the learner and two actors sharing one GPU.
#   bash launch/gpu-checks.sh tests|engine-all|engine-compile|engine-library|bench-engine|bench-learner|bench-actor|bench-weights|run OUT_DIR
# Uses the current python (torch + transformers with CUDA); pyzmq/structlog/... must be importable.
# launch/gpu-rehearsal.sh plays these same checks on a CPU first, under the lent machines' torch and transformers,
# through four variables (unset on a GPU): GPU_CHECKS_DEVICE (cuda), GPU_CHECKS_MODEL (the benches' model
# arguments), GPU_CHECKS_RUN_MODEL (the run's model overrides; the rehearsal's also overlaps
# the engines' windows, as a GPU's engine does by default), and GPU_CHECKS_SMALL (arguments that shrink a bench).
# RUN_OVERRIDES: more overrides for `run`, after its own (e.g. "local.actors=1 actor.max_groups=4", docs/gpu.md).
set -uo pipefail
cd "$(dirname "$0")/.."
what="$1"; out="$2"; mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
# A lent machine lacks some of our pure dependencies: wheels carried in build/wheels go to /tmp/site.
if ls build/wheels/*.whl >/dev/null 2>&1 && ! "$py" -c "import zmq, structlog, msgpack" 2>/dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site build/wheels/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
crl() { "$py" -m launch.cli "$@"; }
dev="${GPU_CHECKS_DEVICE:-cuda}"
read -r -a model <<< "${GPU_CHECKS_MODEL:---shape qwen2.5-0.5b}"
read -r -a small <<< "${GPU_CHECKS_SMALL:-}"
run_model="${GPU_CHECKS_RUN_MODEL:-model.arch=qwen2 model.hidden_size=896 model.num_layers=24 model.num_heads=14 \
model.num_kv_heads=2 model.intermediate_size=4864 model.vocab_size=151936}"
gpus() { nvidia-smi -L 2>&1 | tee "$out/gpu.txt"; }
case "$what" in
  tests)
    gpus
    "$py" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
    "$py" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_learner.py tests/test_actor.py \
      tests/test_weightsync.py tests/test_losses.py 2>&1 | tee "$out/tests.txt" | tail -15
    ;;
  engine-all)
    # One lent GPU session's engine checks in about 9 minutes (the device tool's budget is 15 with the start):
    # the engine's CUDA tests, the engine bench on Qwen2.5-0.5B's shape, then a whole run with that engine.
    gpus
    timeout 150 "$py" -m pytest -q -x -p no:cacheprovider tests/test_gpu.py -k engine 2>&1 | tee "$out/tests.txt" | tail -5
    timeout 240 bash "$0" bench-engine "$out"
    RUN_TIMEOUT=170 timeout 200 bash "$0" run "$out"
    ;;
  engine-compile)
    # The decode step compiled by inductor before graphs capture it, the prefill pass compiled too, and whole windows
    # (steps and their sampling) as one graph each: their CUDA tests, then the engine bench compiled
    # (its ratio is against generate measured in the same run, as the uncompiled figures in docs/gpu.md are; the
    # compilations are paid in the bench's untimed warm-up). The mixed workload is played in groups of 8 rollouts
    # from one first prompt, as the recipes' GRPO groups are (group_size 8). Each workload is played overlapped (the
    # GPU's default) and once more in step (--overlap both: overlap_gain). At most 590 s: one device call (600).
    gpus
    # every test reports (no -x): a VLM capture that fails must not hide the text tests' outcome; -v names each
    # outcome as it comes, so a time limit that cuts the tests short still says which passed (durations: the next
    # plan's sizes)
    timeout 150 "$py" -m pytest -v --durations=0 -p no:cacheprovider tests/test_gpu.py -k "compiled or version_0 or window_graph or graphs_continuous or host_waits" 2>&1 | tee "$out/tests.txt" | tail -5
    timeout 330 "$py" -m launch.cli bench engine --device "$dev" "${model[@]}" "${small[@]}" --compile --group-size 8 \
      --overlap both --profile "$out/profile-compiled.txt" --json 2>>"$out/bench-err.txt" \
      | tee -a "$out/bench-engine-compiled.jsonl" || tail -20 "$out/bench-err.txt"
    # the same fixed batch of 128 uncompiled, same session: what compiling gave, per decode step and per prefill pass
    timeout 110 "$py" -m launch.cli bench engine --device "$dev" "${model[@]}" "${small[@]}" --batch 128 --workload "" \
      --overlap both --json \
      2>>"$out/bench-err.txt" | tee -a "$out/bench-engine-eager.jsonl" || tail -20 "$out/bench-err.txt"
    ;;
  engine-library)
    # transformers' own continuous batching (paged attention; without, then with its CUDA graphs) beside ours and
    # generate, on Qwen2.5-0.5B's shape, every workload: the "library first" comparison docs/actor.md reports.
    # Mixed in groups of 8, as engine-compile plays it. About 6 minutes.
    gpus
    timeout 420 "$py" -m launch.cli bench engine --device "$dev" "${model[@]}" "${small[@]}" --library --group-size 8 --json \
      2>>"$out/bench-err.txt" | tee -a "$out/bench-engine-library.jsonl" || tail -20 "$out/bench-err.txt"
    ;;
  bench-engine)
    # the actor's engine vs transformers' generate (static cache, compiled) on Qwen2.5-0.5B's shape
    crl bench engine --device "$dev" "${model[@]}" "${small[@]}" --profile "$out/profile.txt" --json 2>>"$out/bench-err.txt" \
      | tee -a "$out/bench-engine.jsonl" || tail -20 "$out/bench-err.txt"
    ;;
  bench-learner)
    for args in "--shape qwen2.5-0.5b --groups 2 --group-size 8 --prompt-len 3584 --output-len 512" \
                "--shape qwen2.5-1.5b --groups 2 --group-size 8 --prompt-len 3584 --output-len 512 --micro-batch-tokens 8192" \
                "--shape qwen2.5-1.5b --groups 1 --group-size 8 --prompt-len 7680 --output-len 512 --micro-batch-tokens 8192 --activation-checkpointing"; do
      echo "== bench learner $args"
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True crl bench learner --device cuda --steps 3 $args --json \
        2>>"$out/bench-err.txt" | tee -a "$out/bench-learner.jsonl" || tail -3 "$out/bench-err.txt"
    done
    ;;
  bench-actor)
    for hidden in 64 1024; do
      echo "== bench actor --hidden $hidden"
      crl bench actor --device cuda --groups 4 --hidden $hidden --json 2>>"$out/bench-err.txt" \
        | tee -a "$out/bench-actor.jsonl" || tail -5 "$out/bench-err.txt"
    done
    ;;
  bench-weights)
    # Qwen2.5-0.5B's and 1.5B's parameter counts in bf16 to two receivers on the learner's GPU.
    for params in 494032768 1543714304; do
      for backend in cuda_ipc gloo; do
        echo "== bench weights --params $params --backend $backend"
        crl bench weights --device cuda --params $params --receivers 2 --repeats 3 --backend $backend --json \
          2>>"$out/bench-err.txt" | tee -a "$out/bench-weights.jsonl" || tail -5 "$out/bench-err.txt"
      done
    done
    ;;
  run)
    # Qwen2.5-0.5B's shape (about 1 GB of bf16 weights per round), random weights, byte tokenizer.
    # OUT gets run-report.json and one archive of the rest (the run's stdout, the learner's metrics, each role's
    # log tail): a lent machine's call brings back at most 8 files (launch/rehearsal_outputs.py: returnable).
    rd="${TMPDIR:-/tmp}/gpu-run"; rm -rf "$rd"  # not under OUT: its checkpoints would travel back with it
    files="${TMPDIR:-/tmp}/gpu-run-files"; rm -rf "$files"; mkdir -p "$files"
    # shellcheck disable=SC2086  # the model overrides are words
    timeout "${RUN_TIMEOUT:-360}" "$py" -m launch.cli run configs/local.yaml --run-dir "$rd" model.path= $run_model \
      learner.device="$dev" actor.engine.device="$dev" \
      learner.anchor.suite= learner.total_steps=8 learner.checkpoint_every=0 local.eval_episodes=0 \
      local.torch_threads=4 actor.engine.threads=0 learner.advantage.drop_zero_variance=false weights.timeout_s=120 \
      weights.join_window_s=30 \
      ${RUN_OVERRIDES:-} > "$files/run-stdout.txt" 2>&1
    echo "run exit: $?"
    tail -5 "$files/run-stdout.txt"
    "$py" - "$rd" "$out" <<'PY'
import json, sys, pathlib, statistics
rd, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def lines(p):
    for l in p.read_text().splitlines():
        try: yield json.loads(l)
        except ValueError: pass
steps = [r for r in lines(rd / "metrics/learner.jsonl") if r.get("phase") in ("rl", "sft") and not r.get("empty")]
rounds = [r for f in (rd / "logs").glob("*") for r in lines(f) if r.get("event") == "weights_broadcast"]
actors = [r for f in (rd / "metrics").glob("actor*") for r in lines(f)]
rep = {"steps": len(steps)}
if steps:
    busy = sum(r["tokens"] / r["tokens_per_s"] for r in steps)
    wall = steps[-1]["time"] - steps[0]["time"] + steps[0]["tokens"] / steps[0]["tokens_per_s"]
    rep["learner_wall_s"] = round(wall, 1)
    rep["learner_idle_ratio"] = round(1 - busy / wall, 3)
    rep["steps_per_s"] = round(len(steps) / wall, 4)
    rep["step_seconds_mean"] = round(busy / len(steps), 3)
    rep["train_tokens_per_step"] = round(statistics.mean(r["tokens"] for r in steps))
    rep["learner_busy_s"] = round(busy, 1)
    rep["learner_time_split_s"] = {k: v for k, v in steps[-1].items() if k.startswith("time_")}  # whole loop, by kind
if rounds:
    secs = [r["seconds"] for r in rounds]
    rep.update(weight_rounds=len(secs), weight_round_s_median=statistics.median(secs),
               weight_round_s_first=secs[0], weight_round_s_max=max(secs),
               weight_backend=rounds[-1].get("backend"), receivers=rounds[-1].get("receivers"))
if actors:
    last = {}
    for r in actors: last[r.get("rank")] = r
    for key in ("engine_idle_ratio", "gen_tokens_per_s", "wall_s", "engine_prefill_share", "engine_decode_ms_per_step",
                "engine_mean_batch", "engine_late_row_share"):  # each actor's last record: rate, wall time, engine by phase
        rep[f"actor_{key}"] = {k: v.get(key) for k, v in last.items()}
print(json.dumps(rep, indent=1))
(out / "run-report.json").write_text(json.dumps(rep, indent=1))
PY
    cp "$rd/metrics/learner.jsonl" "$files/" 2>/dev/null
    for f in "$rd"/logs/*; do tail -c 2000000 "$f" > "$files/log-$(basename "$f")"; done 2>/dev/null
    tar czf "$out/run-files.tgz" -C "$files" .
    ls "$rd/logs" "$rd/metrics"
    ;;
esac
