#!/usr/bin/env bash
# Multi-GPU runs of every parallelism on one host (NCCL), compared with the 1-GPU run of the same global batch.
#   bash .gpu/setup.sh && OUT=/path bash benchmarks/multi_gpu.sh PHASE [PHASE ...]
# Phases:
#   efficiency  every layout against one GPU running the same model, as one table (issue 14): FSDP2 at 1.3B
#            (4 x 4096 per GPU) and 370M (8 x 2048), PP2 1F1B and Interleaved1F1B at 1.3B (8 microbatches of 4 x 4096),
#            CP2 at 32k and 64k tokens (1.3B, full AC) against cp 1, EP2 on the hybrid MoE 1B; HSDP 2x2 with 4+ GPUs.
#            Runs share the GPUs (gpu_pool: 1-GPU references side by side, on 4 GPUs also two 2-GPU runs). env: EFF_ROWS (names to run, default all; "table": the table's own runs),
#            EFF_PROFILE=1 (also profile step 14 of every run and summarise rank 0 / 1's traces; the table uses 4-12),
#            GPUS (the GPU ids gpu_pool hands out, default 0 .. NG-1: "2 3" with NG=2 runs a second table beside a first),
#            EFF_REPEAT=N (every run N times, in turn; each row's ratio the median of its N pairs, with their range)
#   eight_efficiency  issue 20 on one 8-GPU host, as one table: FSDP8 and HSDP 2x4 at 1.3B / 2.7B (4 x 4096 per GPU),
#            and PP2 x CP2 x FSDP2 at 64k tokens (1.3B; hybrid MoE with EP2), 20 steps, against one GPU running the
#            same model, context and global batch (full AC); then the composition's step-10 checkpoint resumed under
#            FSDP8 to step 20. The 1-GPU references run side by side, one per GPU. env: EFF_ROWS as above,
#            RUN_TIMEOUT (seconds per run, default 400)
#   stable   the parity set at lr 3e-4: 1 GPU vs FSDP2, FSDP4, HSDP 2x2, PP2xCP2 (130M, global batch 16, 20 steps)
#            (step 8 of every run is profiled; benchmarks/trace_summary.py splits it into compute / NCCL / idle)
#   ddp      weak scaling 1 / 2 / 4 GPUs with plain data parallel + training.cuda_graph (130M), and DDP4 eager
#   units    FSDP4 with 1 vs 4 blocks per FSDP unit, and without resharding after forward (130M)
#   eight    8 GPUs: 1.3B PP2 x CP2 x FSDP2 and hybrid MoE PP2 x CP2 x FSDP2 x EP2 vs 1 GPU; resume under FSDP8
#   eight_ref  only eight's two 1-GPU reference runs (eight skips references that exist)
#   nccl     collective time and bus bandwidth for 0.25-256 MiB per rank (benchmarks/nccl_bandwidth.py)
#   parity   130M, seq 2048, global batch 16, 20 steps: 1 GPU vs FSDP4, HSDP 2x2, PP2xFSDP2, CP2xFSDP2 (balanced), PP2xCP2
#   hybrid   hybrid MoE 1B, seq 2048, global batch 8, 20 steps: 1 GPU vs EP4, PP2xFSDP2xEP2
#   scaling  370M, 8 x 2048 per GPU, 12 steps on 1, 2 and 4 GPUs (weak scaling of tokens/s per GPU)
#   longctx  370M, one sequence of 32k tokens at cp 1 / 2 / 4 and 128k at cp 4, full activation checkpointing
#   bubble   PP2 step time and bubble per schedule (benchmarks/pp_bubble.py, 370M width, 16 layers)
#            (ZBVZeroBubble: add it to BUBBLE_SCHEDULES with torch >= 2.13)
#            env: BUBBLE_SCHEDULES, BUBBLE_FLAVOR, BUBBLE_SEQ, BUBBLE_MB (microbatches, default 8)
#   pp370m   PP2 (1F1B, GPipe; 8 microbatches) trains the 48-layer 370M on 2 GPUs vs 1 GPU, 12 steps
#            env: PP_SCHEDULES, PP_MB (microbatch size, default 1), SKIP_REF=1 (no 1-GPU run)
# Each phase prints a table (benchmarks/compare_runs.py) and leaves metrics.jsonl + logs under $OUT/<phase>/.
# Exit status: 1 when a row of the efficiency table misses its target, 2 for an unknown phase, else 0.
# On 4+ GPUs the efficiency phase runs two 2-GPU runs at once (gpu_pool: every run on GPUs of its own).
# Dry run of the plumbing on a CPU (gloo, a tiny model; no figures): NG=4 EXTRA="$(cat benchmarks/tiny_overrides.txt)"
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-./outputs/multi_gpu}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 TRITON_CACHE_AUTOTUNING=1
NG=${NG:-$(python3 -c 'import torch; print(torch.cuda.device_count())')}
RDZV="--rdzv_backend c10d --rdzv_endpoint localhost:0"  # a free port: groups of GPUs can run phases side by side
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"  # appended to every run: later overrides win

run() {  # run NAME NGPU CONFIG [overrides...]
  local name=$1 n=$2 cfg=$3; shift 3
  [ "$n" -gt "$NG" ] && { echo "skip $name: needs $n GPUs"; return; }
  local dir="$OUT/$PHASE/$name"; [ -n "${KEEP:-}" ] || rm -rf "$dir"; mkdir -p "$dir"  # KEEP=1: resume what is there
  local t0=$SECONDS
  CONFIG_FILE=$cfg NGPU=$n FORCE_TORCHRUN=1 timeout ${RUN_TIMEOUT:-400} ./run_train.sh --job.dump_folder "$dir" \
    --checkpoint.enable false --metrics.enable_tensorboard false "$@" "${EXTRA_ARGS[@]}" > "$dir/log.txt" 2>&1
  echo "$name: rc=$? $((SECONDS - t0))s $(tail -1 "$dir/metrics.jsonl" 2>/dev/null | cut -c1-160)"
  [ -s "$dir/metrics.jsonl" ] || tail -20 "$dir/log.txt"
}

gpu_pool() {  # gpu_pool "NAME NGPU CONFIG [overrides...]" ...: each run (those `want` takes) on GPUs of its own, started
  # in the order given as soon as enough GPUs are free; returns when all have ended. Arguments split on spaces.
  local -a free a gpus; local -A held=(); local spec pid n
  read -r -a free <<< "${GPUS:-$(seq -s ' ' 0 $((NG - 1)))}"
  for spec in "$@"; do
    read -r -a a <<< "$spec"; n=${a[1]}
    want "${a[0]}" || continue
    [ "$n" -gt "$NG" ] && { echo "skip ${a[0]}: needs $n GPUs"; continue; }
    while [ "${#free[@]}" -lt "$n" ]; do  # wait for a run to end and take its GPUs back
      wait -n -p pid; read -r -a gpus <<< "${held[$pid]}"; free+=("${gpus[@]}"); unset "held[$pid]"
    done
    gpus=("${free[@]:0:n}"); free=("${free[@]:n}")
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]}") run "${a[0]}" "$n" "${a[@]:2}" &
    held[$!]="${gpus[*]}"
  done
  wait
}

for PHASE in "$@"; do
  echo "=== $PHASE ($NG GPUs) ==="
  case $PHASE in
  parity)
    C=configs/mamba2_130m.toml
    A=(--training.steps 20 --training.seq_len 2048 --training.global_batch_size 16 --training.local_batch_size 4
       --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --training.seed 7 --model.tie_embeddings false)
    P=--parallelism
    run 1gpu 1 $C "${A[@]}"
    run fsdp4 4 $C "${A[@]}" $P.data_parallel_shard_degree 4
    run hsdp2x2 4 $C "${A[@]}" $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2
    run pp2xfsdp2 4 $C "${A[@]}" $P.pipeline_parallel_degree 2 $P.pipeline_parallel_microbatch_size 4
    run cp2xfsdp2 4 $C "${A[@]}" $P.context_parallel_degree 2 $P.context_parallel_load_balance true
    run pp2xcp2 4 $C "${A[@]}" $P.pipeline_parallel_degree 2 $P.pipeline_parallel_microbatch_size 4 $P.context_parallel_degree 2
    python3 benchmarks/compare_runs.py --ref "$OUT/parity/1gpu" "$OUT"/parity/{fsdp4,hsdp2x2,pp2xfsdp2,cp2xfsdp2,pp2xcp2} --json "$OUT/parity.json" ;;
  efficiency)
    P=--parallelism
    S=(--metrics.log_freq 1 --validation.enable false --training.steps 14)
    UNTIL=0
    if [ -n "${EFF_PROFILE:-}" ]; then  # profile the last step of every run; the table then stops at step 12
      S+=(--profiling.enable_profiling true --profiling.profile_steps "[14]"); UNTIL=12; fi
    L=(--training.local_batch_size 1 --training.global_batch_size 1 --activation_checkpoint.mode full
       --training.loss_chunk_tokens 8192 $P.data_parallel_shard_degree 1)  # long context: one sequence per step
    M13=(configs/mamba2_1.3b.toml "${S[@]}" --training.seq_len 4096 --training.local_batch_size 4)
    M370=(configs/mamba2_370m.toml "${S[@]}" --training.seq_len 2048 --training.local_batch_size 8)
    MOE=(configs/hybrid_moe_1b.toml "${S[@]}" --training.seq_len 4096 --training.local_batch_size 4)
    PP=(configs/mamba2_1.3b.toml "${S[@]}" --training.seq_len 4096 --training.global_batch_size 32
        $P.pipeline_parallel_degree 2 $P.pipeline_parallel_microbatch_size 4 $P.data_parallel_shard_degree 1)
    # EFF_ROWS=table: the issue-14 table's own runs (its rows and their references, HSDP with 4+ GPUs), no extra rows
    [ "${EFF_ROWS:-}" = table ] && EFF_ROWS="1gpu_1.3b fsdp2_1.3b hsdp2x2_1.3b 1gpu_370m fsdp2_370m 1gpu_370m_graph
      fsdp2_370m_graph pp2_1f1b_1.3b pp2_interleaved_1.3b cp1_32k cp2_32k cp1_64k cp2_64k 1gpu_moe ep2_moe"
    want() { [ -z "${EFF_ROWS:-}" ] || [[ " ${EFF_ROWS//$'\n'/ } " == *" $1 "* ]]; }
    N13=(configs/mamba2_1.3b.toml "${S[@]}" "${L[@]}")  # the long-context runs
    # pp2_*_even: the split before 2026-11-28 (the head not weighed, the embedding as a layer): 24 / 24 under 1F1B and
    # 11 / 13 / 12 / 12 under Interleaved1F1B, against the default's 26 / 22 and 13 / 13 / 13 / 9
    EVEN=($P.pipeline_parallel_head_weight 0 $P.pipeline_parallel_first_last_stage_weight 1)
    # fsdp2_370m_units: 4 units of 15 blocks resharded after forward (the default before 2026-11-28, which kept the last
    # unit gathered; "always" reshards it too), against the
    # default's blocks in the root's unit (the 370M's gathered parameters take < 2 GiB; one unit of 48 before session 32)
    UNITS=($P.fsdp_blocks_per_unit 15)
    # distopt2_*: plain data parallel with the distributed optimizer (the moments sharded over the 2 ranks, gradients
    # reduce-scattered and weights all-gathered once per step; parallelisms/distributed_optimizer.py), with and
    # without the CUDA graph, against one GPU run the same way
    DISTOPT=($P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 1 $P.distributed_optimizer true)
    # Every run of the table, longest first within each size, as "NAME NGPU CONFIG ARGS...". gpu_pool runs them on
    # the host's GPUs, each as soon as enough are free (2 GPUs: the 1-GPU references two at a time as before; 4 GPUs:
    # also two 2-GPU runs at once, on GPUs 0-1 and 2-3).
    # EFF_REPEAT=N: the runs N times over (folders efficiency/rep1 .. repN), each row's ratio the median of N pairs
    DIRS=()
    for rep in $(seq 1 "${EFF_REPEAT:-1}"); do
      [ "${EFF_REPEAT:-1}" -gt 1 ] && PHASE=efficiency/rep$rep
      DIRS+=("$OUT/$PHASE")
      gpu_pool \
        "cp1_64k 1 ${N13[*]} --training.seq_len 65536" "cp1_32k 1 ${N13[*]} --training.seq_len 32768" \
        "1gpu_1.3b 1 ${M13[*]}" "1gpu_moe 1 ${MOE[*]}" "1gpu_370m 1 ${M370[*]}" \
        "pp2_1f1b_1.3b 2 ${PP[*]} $P.pipeline_parallel_schedule 1F1B" \
        "pp2_interleaved_1.3b 2 ${PP[*]} $P.pipeline_parallel_schedule Interleaved1F1B" \
        "cp2_64k 2 ${N13[*]} --training.seq_len 65536 $P.context_parallel_degree 2" \
        "cp2_32k 2 ${N13[*]} --training.seq_len 32768 $P.context_parallel_degree 2" \
        "fsdp2_1.3b 2 ${M13[*]} $P.data_parallel_shard_degree 2" \
        "ep2_moe 2 ${MOE[*]} $P.expert_parallel_degree 2" \
        "fsdp2_370m 2 ${M370[*]} $P.data_parallel_shard_degree 2" \
        "pp2_1f1b_even_1.3b 2 ${PP[*]} $P.pipeline_parallel_schedule 1F1B ${EVEN[*]}" \
        "pp2_interleaved_even_1.3b 2 ${PP[*]} $P.pipeline_parallel_schedule Interleaved1F1B ${EVEN[*]}" \
        "fsdp2_370m_units 2 ${M370[*]} $P.data_parallel_shard_degree 2 ${UNITS[*]} $P.fsdp_reshard_after_forward always" \
        "fsdp2_370m_bf16reduce 2 ${M370[*]} $P.data_parallel_shard_degree 2 --training.mixed_precision_reduce bfloat16" \
        "ep2_moe_bf16reduce 2 ${MOE[*]} $P.expert_parallel_degree 2 --training.mixed_precision_reduce bfloat16" \
        "hsdp2x2_1.3b 4 ${M13[*]} $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2" \
        "1gpu_370m_graph 1 ${M370[*]} --training.cuda_graph true" \
        "ddp2_370m_graph 2 ${M370[*]} $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 1 --training.cuda_graph true" \
        "distopt2_370m_graph 2 ${M370[*]} ${DISTOPT[*]} --training.cuda_graph true" \
        "fsdp2_370m_graph 2 ${M370[*]} $P.data_parallel_shard_degree 2 --training.cuda_graph true" \
        "distopt2_370m 2 ${M370[*]} ${DISTOPT[*]}" \
        "cp2_32k_nooverlap 2 ${N13[*]} --training.seq_len 32768 $P.context_parallel_degree 2 $P.context_parallel_overlap false" \
        "cp2_32k_gathered 2 ${N13[*]} --training.seq_len 32768 $P.context_parallel_degree 2 $P.fsdp_reshard_after_forward never"
    done
    PHASE=efficiency
    # cp2_32k_gathered: FSDP's units (over the CP ranks) not resharded after forward, so the backward (and full AC's
    # recompute) gathers nothing again: fewer collectives beside the all-to-alls, more memory
    # *_bf16reduce: gradients reduce-scattered in bf16 (training.mixed_precision_reduce), half the bytes.
    # targets: FSDP / HSDP 0.90; PP 0.9 x (1 - textbook bubble (p-1)/(v*m+p-1)): 1F1B 1/9, interleaved (v=2) 1/17;
    # CP 0.75 with memory <= 0.55 of cp 1; EP 0.75
    ROWS=("FSDP2 1.3B, 4 x 4096 per GPU=fsdp2_1.3b:1gpu_1.3b:0.90" "FSDP2 370M, 8 x 2048 per GPU=fsdp2_370m:1gpu_370m:0.90"
          "PP2 1F1B 1.3B, 8 x (4 x 4096)=pp2_1f1b_1.3b:1gpu_1.3b:0.80"
          "PP2 Interleaved1F1B 1.3B, 8 x (4 x 4096)=pp2_interleaved_1.3b:1gpu_1.3b:0.847"
          "PP2 1F1B 1.3B, even split (before)=pp2_1f1b_even_1.3b:1gpu_1.3b:0.80"
          "PP2 Interleaved1F1B 1.3B, even split (before)=pp2_interleaved_even_1.3b:1gpu_1.3b:0.847"
          "FSDP2 370M, 4 resharded units (before)=fsdp2_370m_units:1gpu_370m:0.90"
          "CP2 1.3B, 32k tokens, full AC=cp2_32k:cp1_32k:0.75:0.55" "CP2 1.3B, 64k tokens, full AC=cp2_64k:cp1_64k:0.75:0.55"
          "EP2 hybrid MoE 1B, 4 x 4096 per GPU=ep2_moe:1gpu_moe:0.75"
          "FSDP2 370M, bf16 gradient reduction=fsdp2_370m_bf16reduce:1gpu_370m:0.90"
          "EP2 hybrid MoE 1B, bf16 gradient reduction=ep2_moe_bf16reduce:1gpu_moe:0.75"
          "DDP2 370M + CUDA graph (1 GPU with the graph)=ddp2_370m_graph:1gpu_370m_graph:0.90"
          "DDP2 + distributed optimizer 370M + CUDA graph (1 GPU with the graph)=distopt2_370m_graph:1gpu_370m_graph:0.90"
          "DDP2 + distributed optimizer 370M, eager=distopt2_370m:1gpu_370m:0.90"
          "FSDP2 370M + CUDA graph (1 GPU with the graph)=fsdp2_370m_graph:1gpu_370m_graph:0.90"
          "CP2 1.3B, 32k, in_proj's all-to-all not overlapped=cp2_32k_nooverlap:cp1_32k:0.75:0.55"
          "CP2 1.3B, 32k, FSDP units kept gathered to the backward=cp2_32k_gathered:cp1_32k:0.75:0.55")
    [ "$NG" -ge 4 ] && ROWS+=("HSDP 2x2 1.3B, 4 x 4096 per GPU=hsdp2x2_1.3b:1gpu_1.3b:0.90")
    R=(); for row in "${ROWS[@]}"; do want "$(echo "$row" | cut -d= -f2 | cut -d: -f1)" && R+=(--row "$row"); done
    B=(--bubble pp2_1f1b_1.3b=$(python3 -c 'print(1/9)') --bubble pp2_interleaved_1.3b=$(python3 -c 'print(1/17)')
       --bubble pp2_1f1b_even_1.3b=$(python3 -c 'print(1/9)') --bubble pp2_interleaved_even_1.3b=$(python3 -c 'print(1/17)'))
    python3 benchmarks/efficiency_table.py "${DIRS[@]}" "${R[@]}" "${B[@]}" --until $UNTIL --json "$OUT/efficiency.json" \
      || STATUS=1  # a row missed its target (or lost its runs): the script's exit status says so
    if [ -n "${EFF_PROFILE:-}" ]; then  # where each run's profiled step went (rank 0 and 1)
      for t in "$OUT"/efficiency/{,rep*/}*/profile_trace/iteration_14/rank[01]_trace.json; do
        if [ -e "$t" ]; then python3 benchmarks/trace_summary.py --top 6 "$t"; fi; done  # (it names the trace)
    fi ;;
  eight_efficiency)
    P=--parallelism
    S=(--metrics.log_freq 1 --validation.enable false --training.steps 14)
    want() { [ -z "${EFF_ROWS:-}" ] || [[ " $EFF_ROWS " == *" $1 "* ]]; }
    W=(--training.seq_len 4096 --training.local_batch_size 4)   # weak scaling: 4 x 4096 per GPU
    # long context: 8 sequences of 64k per step (FSDP8 resumes it: dp 8), one GPU accumulates them one at a time
    # (~6 minutes for 20 steps of the 1.3B on an H200: give RUN_TIMEOUT=900, or split the rows over calls with EFF_ROWS)
    LC=(--metrics.log_freq 1 --validation.enable false --training.steps 20 --training.seq_len 65536
        --training.global_batch_size 8 --training.local_batch_size 1 --activation_checkpoint.mode full
        --training.loss_chunk_tokens 8192 --lr_scheduler.warmup_steps 5 --optimizer.lr 3e-4 --training.seed 7
        --model.tie_embeddings false)
    COMPOSE=($P.pipeline_parallel_degree 2 $P.context_parallel_degree 2 $P.data_parallel_shard_degree 2
             $P.pipeline_parallel_microbatch_size 1)
    i=0; for spec in "1gpu_1.3b configs/mamba2_1.3b.toml" "1gpu_2.7b configs/mamba2_2.7b.toml"; do
      read -r name cfg <<< "$spec"; want $name || continue
      CUDA_VISIBLE_DEVICES=$i run $name 1 $cfg "${S[@]}" "${W[@]}" & i=$((i + 1)); done
    for spec in "1gpu_1.3b_64k configs/mamba2_1.3b.toml" "1gpu_moe_64k configs/hybrid_moe_1b.toml"; do
      read -r name cfg <<< "$spec"; want $name || continue
      CUDA_VISIBLE_DEVICES=$i run $name 1 $cfg "${LC[@]}" & i=$((i + 1)); done
    wait
    for m in 1.3b 2.7b; do
      want fsdp8_$m && run fsdp8_$m 8 configs/mamba2_$m.toml "${S[@]}" "${W[@]}" $P.data_parallel_shard_degree 8
      want hsdp2x4_$m && run hsdp2x4_$m 8 configs/mamba2_$m.toml "${S[@]}" "${W[@]}" $P.data_parallel_replicate_degree 2 \
        $P.data_parallel_shard_degree 4
    done
    if want pp2cp2fsdp2_1.3b_64k; then
      run pp2cp2fsdp2_1.3b_64k 8 configs/mamba2_1.3b.toml "${LC[@]}" "${COMPOSE[@]}" --checkpoint.enable true --checkpoint.interval 10
      rm -rf "$OUT/$PHASE/resume_fsdp8_64k"; mkdir -p "$OUT/$PHASE/resume_fsdp8_64k/checkpoint"
      cp -rl "$OUT/$PHASE/pp2cp2fsdp2_1.3b_64k/checkpoint/step-10" "$OUT/$PHASE/resume_fsdp8_64k/checkpoint/" \
        || echo "resume_fsdp8_64k: no step-10 checkpoint to resume from; not run"  # hard links
      [ -d "$OUT/$PHASE/resume_fsdp8_64k/checkpoint/step-10" ] && KEEP=1 run resume_fsdp8_64k 8 configs/mamba2_1.3b.toml \
        "${LC[@]}" $P.data_parallel_shard_degree 8 $P.context_parallel_degree 1 --checkpoint.enable true --checkpoint.interval 100
    fi
    want pp2cp2fsdp2ep2_moe_64k && run pp2cp2fsdp2ep2_moe_64k 8 configs/hybrid_moe_1b.toml "${LC[@]}" "${COMPOSE[@]}" \
      $P.expert_parallel_degree 2
    R=()
    for row in "FSDP8 1.3B, 4 x 4096 per GPU=fsdp8_1.3b:1gpu_1.3b:0.88" "HSDP 2x4 1.3B=hsdp2x4_1.3b:1gpu_1.3b:0.88" \
               "FSDP8 2.7B, 4 x 4096 per GPU=fsdp8_2.7b:1gpu_2.7b:0.88" "HSDP 2x4 2.7B=hsdp2x4_2.7b:1gpu_2.7b:0.88" \
               "PP2 x CP2 x FSDP2 1.3B, 64k=pp2cp2fsdp2_1.3b_64k:1gpu_1.3b_64k:0.60" \
               "PP2 x CP2 x FSDP2 x EP2 hybrid MoE, 64k=pp2cp2fsdp2ep2_moe_64k:1gpu_moe_64k:0.60"; do
      want "$(echo "$row" | cut -d= -f2 | cut -d: -f1)" && R+=(--row "$row"); done
    python3 benchmarks/efficiency_table.py "$OUT/$PHASE" "${R[@]}" --json "$OUT/eight_efficiency.json"
    # bf16 losses of the compositions against one GPU, step by step (the resume: steps 11-20 against the same run)
    want pp2cp2fsdp2_1.3b_64k && python3 benchmarks/compare_runs.py --ref "$OUT/$PHASE/1gpu_1.3b_64k" \
      "$OUT"/$PHASE/{pp2cp2fsdp2_1.3b_64k,resume_fsdp8_64k} --json "$OUT/eight_1.3b_64k_losses.json"
    want pp2cp2fsdp2ep2_moe_64k && python3 benchmarks/compare_runs.py --ref "$OUT/$PHASE/1gpu_moe_64k" \
      "$OUT/$PHASE/pp2cp2fsdp2ep2_moe_64k" --json "$OUT/eight_moe_64k_losses.json" ;;
  stable)  # the parity set at a stable learning rate (3e-4), where bf16 rounding differences do not get amplified
    C=configs/mamba2_130m.toml
    A=(--training.steps 20 --training.seq_len 2048 --training.global_batch_size 16 --training.local_batch_size 4
       --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --training.seed 7 --model.tie_embeddings false
       --optimizer.lr 3e-4 --profiling.enable_profiling true --profiling.profile_steps "[8]")
    P=--parallelism
    run 1gpu 1 $C "${A[@]}"
    run fsdp2 2 $C "${A[@]}" $P.data_parallel_shard_degree 2
    run fsdp4 4 $C "${A[@]}" $P.data_parallel_shard_degree 4
    run hsdp2x2 4 $C "${A[@]}" $P.data_parallel_replicate_degree 2 $P.data_parallel_shard_degree 2
    run pp2xcp2 4 $C "${A[@]}" $P.pipeline_parallel_degree 2 $P.pipeline_parallel_microbatch_size 4 $P.context_parallel_degree 2
    python3 benchmarks/compare_runs.py --ref "$OUT/stable/1gpu" "$OUT"/stable/{fsdp2,fsdp4,hsdp2x2,pp2xcp2} --json "$OUT/stable.json"
    T=("$OUT"/stable/*/profile_trace/iteration_8/rank0_trace.json)
    [ -e "${T[0]}" ] && python3 benchmarks/trace_summary.py --top 8 "${T[@]}" --json "$OUT/stable_traces.jsonl" ;;
  ddp)  # weak scaling with plain data parallel + CUDA graphs (130M, 4 x 2048 per GPU) next to FSDP
    C=configs/mamba2_130m.toml
    A=(--training.steps 20 --training.seq_len 2048 --training.local_batch_size 4 --metrics.log_freq 1
       --lr_scheduler.warmup_steps 5 --optimizer.lr 3e-4 --training.seed 7 --model.tie_embeddings false)
    G=(--training.cuda_graph true)
    R=--parallelism.data_parallel_replicate_degree
    run 1gpu 1 $C "${A[@]}" --training.global_batch_size 4
    run 1gpu_graph 1 $C "${A[@]}" --training.global_batch_size 4 "${G[@]}"
    run ddp2_graph 2 $C "${A[@]}" --training.global_batch_size 8 $R 2 --parallelism.data_parallel_shard_degree 1 "${G[@]}"
    run ddp4_graph 4 $C "${A[@]}" --training.global_batch_size 16 $R 4 --parallelism.data_parallel_shard_degree 1 "${G[@]}"
    run ddp4 4 $C "${A[@]}" --training.global_batch_size 16 $R 4 --parallelism.data_parallel_shard_degree 1
    python3 benchmarks/compare_runs.py --rtol 1 --ref "$OUT/ddp/1gpu" "$OUT"/ddp/{1gpu_graph,ddp2_graph,ddp4_graph,ddp4} --json "$OUT/ddp.json" ;;
  units)  # FSDP4 host time: one unit per block vs 4 blocks per unit vs no resharding (130M, 4 x 2048 per GPU)
    C=configs/mamba2_130m.toml
    A=(--training.steps 20 --training.seq_len 2048 --training.global_batch_size 16 --training.local_batch_size 4
       --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --training.seed 7 --model.tie_embeddings false
       --optimizer.lr 3e-4 --parallelism.data_parallel_shard_degree 4)
    run fsdp4 4 $C "${A[@]}"
    run fsdp4_units4 4 $C "${A[@]}" --parallelism.fsdp_blocks_per_unit 4
    run fsdp4_noreshard 4 $C "${A[@]}" --parallelism.fsdp_reshard_after_forward never
    python3 benchmarks/compare_runs.py --ref "$OUT/units/fsdp4" "$OUT"/units/{fsdp4_units4,fsdp4_noreshard} --json "$OUT/units.json" ;;
  eight_ref|eight)  # issue 8 on one 8-GPU host: PP2 x CP2 x FSDP2 (+EP2 for the MoE) vs 1 GPU, 20 steps; resume under FSDP8
    # eight_ref runs only the two 1-GPU references (on a spare GPU beside other phases); eight runs what is missing.
    P=--parallelism
    L=(--training.steps 20 --training.seq_len 4096 --training.global_batch_size 8 --training.local_batch_size 2
       --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --training.seed 7 --model.tie_embeddings false
       --optimizer.lr 3e-4 --training.loss_chunk_tokens 8192)
    COMPOSE=($P.pipeline_parallel_degree 2 $P.context_parallel_degree 2 $P.data_parallel_shard_degree 2
             $P.pipeline_parallel_microbatch_size 1)
    ONLY_REF=$([ "$PHASE" = eight_ref ] && echo 1); PHASE=eight
    [ -s "$OUT/eight/1gpu_1.3b/metrics.jsonl" ] || run 1gpu_1.3b 1 configs/mamba2_1.3b.toml "${L[@]}"
    [ -s "$OUT/eight/1gpu_moe/metrics.jsonl" ] || run 1gpu_moe 1 configs/hybrid_moe_1b.toml "${L[@]}" --model.moe_load_balance_coeff 1e-2
    [ -n "$ONLY_REF" ] && continue
    run pp2cp2fsdp2_1.3b 8 configs/mamba2_1.3b.toml "${L[@]}" "${COMPOSE[@]}" --checkpoint.enable true --checkpoint.interval 10
    rm -rf "$OUT/eight/resume_fsdp8"; mkdir -p "$OUT/eight/resume_fsdp8/checkpoint"
    cp -rl "$OUT/eight/pp2cp2fsdp2_1.3b/checkpoint/step-10" "$OUT/eight/resume_fsdp8/checkpoint/" \
      || echo "resume_fsdp8: no step-10 checkpoint to resume from: it would train from scratch; not run"  # hard links
    [ -d "$OUT/eight/resume_fsdp8/checkpoint/step-10" ] && \
    KEEP=1 run resume_fsdp8 8 configs/mamba2_1.3b.toml "${L[@]}" --checkpoint.enable true --checkpoint.interval 100 \
      $P.data_parallel_shard_degree 8 --training.local_batch_size 1
    run pp2cp2fsdp2ep2_moe 8 configs/hybrid_moe_1b.toml "${L[@]}" "${COMPOSE[@]}" $P.expert_parallel_degree 2 \
      --model.moe_load_balance_coeff 1e-2
    python3 benchmarks/compare_runs.py --ref "$OUT/eight/1gpu_1.3b" "$OUT"/eight/{pp2cp2fsdp2_1.3b,resume_fsdp8} --json "$OUT/eight_1.3b.json"
    python3 benchmarks/compare_runs.py --ref "$OUT/eight/1gpu_moe" "$OUT/eight/pp2cp2fsdp2ep2_moe" --json "$OUT/eight_moe.json" ;;
  nccl)  # collective time and bus bandwidth, 0.25-256 MiB per rank
    python3 -m torch.distributed.run --nproc_per_node "$NG" $RDZV benchmarks/nccl_bandwidth.py 2>&1 | grep -v Warn ;;
  hybrid)
    C=configs/hybrid_moe_1b.toml
    A=(--training.steps 20 --training.seq_len 2048 --training.global_batch_size 8 --training.local_batch_size 2
       --lr_scheduler.warmup_steps 5 --metrics.log_freq 1 --training.seed 7 --model.moe_load_balance_coeff 1e-2)
    P=--parallelism
    run 1gpu 1 $C "${A[@]}"
    run ep4 4 $C "${A[@]}" $P.expert_parallel_degree 4
    run pp2xfsdp2xep2 4 $C "${A[@]}" $P.pipeline_parallel_degree 2 $P.pipeline_parallel_microbatch_size 2 $P.expert_parallel_degree 2
    python3 benchmarks/compare_runs.py --ref "$OUT/hybrid/1gpu" "$OUT"/hybrid/{ep4,pp2xfsdp2xep2} --json "$OUT/hybrid.json" ;;
  scaling)
    C=configs/mamba2_370m.toml
    A=(--training.steps 12 --training.seq_len 2048 --training.local_batch_size 8 --metrics.log_freq 1)
    run 1gpu 1 $C "${A[@]}"
    run fsdp2 2 $C "${A[@]}"
    run fsdp4 4 $C "${A[@]}"
    python3 benchmarks/compare_runs.py --rtol 1 --ref "$OUT/scaling/1gpu" "$OUT"/scaling/{fsdp2,fsdp4} --json "$OUT/scaling.json" ;;
  longctx)
    C=configs/mamba2_370m.toml
    P=--parallelism
    for L in 32768 131072; do
      A=(--training.steps 5 --training.seq_len $L --training.local_batch_size 1 --training.global_batch_size 1
         --activation_checkpoint.mode full --training.loss_chunk_tokens 8192 --metrics.log_freq 1)
      for CP in 1 2 4; do
        [ $L -ge 131072 ] && [ $CP -lt 4 ] && continue
        run seq${L}_cp${CP} $CP $C "${A[@]}" $P.context_parallel_degree $CP $P.data_parallel_shard_degree 1
      done
    done
    python3 benchmarks/compare_runs.py --rtol 1 --skip 2 --ref "$OUT/longctx/seq32768_cp1" "$OUT"/longctx/seq* --json "$OUT/longctx.json" ;;
  bubble)  # the whole log stays in $OUT/bubble.log (a failing schedule's traceback included)
    mkdir -p "$OUT/bubble"
    timeout 300 python3 -m torch.distributed.run --nproc_per_node 2 $RDZV benchmarks/pp_bubble.py --flavor ${BUBBLE_FLAVOR:-370M} \
      --n_layers 16 --seq_len ${BUBBLE_SEQ:-2048} --microbatches ${BUBBLE_MB:-8} --steps 4 --schedules ${BUBBLE_SCHEDULES:-GPipe,1F1B,Interleaved1F1B} \
      --json "$OUT/bubble/bubble.jsonl" > "$OUT/bubble.log" 2>&1
    grep -v Warning "$OUT/bubble.log" | grep -E "step .* bubble|Error|error:" | head -20 ;;
  pp370m)  # PP2 trains the whole 48-layer 370M config on 2 GPUs, next to the same global batch on 1 GPU
    C=configs/mamba2_370m.toml
    A=(--training.steps 12 --training.seq_len 2048 --training.global_batch_size 8 --training.local_batch_size 8
       --metrics.log_freq 1 --training.loss_chunk_tokens 8192 --lr_scheduler.warmup_steps 5 --optimizer.lr 3e-4
       --model.tie_embeddings false)
    [ -n "${SKIP_REF:-}" ] || run 1gpu 1 $C "${A[@]}"
    MB=${PP_MB:-1}; SUFFIX=$([ "$MB" = 1 ] || echo _mb$MB)
    for S in ${PP_SCHEDULES:-1F1B GPipe}; do
      run pp2_$S$SUFFIX 2 $C "${A[@]}" --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule $S \
        --parallelism.pipeline_parallel_microbatch_size $MB
    done
    python3 benchmarks/compare_runs.py --ref "$OUT/pp370m/1gpu" "$OUT"/pp370m/pp2_* --json "$OUT/pp370m.json" ;;
  *) echo "unknown phase $PHASE"; STATUS=2 ;;
  esac
done
exit "${STATUS:-0}"
