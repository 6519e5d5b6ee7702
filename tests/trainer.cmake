# Whole-run trainer tests under mpiexec (tests/tools/trainer_runs.sh): equivalence of layouts
# with the one-rank loss curve, determinism, and bit-identical resume.
if(NOT TARGET quilt_cli)  # tools not built: nothing to run
  return()
endif()
add_executable(metrics_compare ${CMAKE_CURRENT_SOURCE_DIR}/tools/metrics_compare.cpp)
target_link_libraries(metrics_compare PRIVATE nlohmann_json::nlohmann_json)
add_executable(trace_check ${CMAKE_CURRENT_SOURCE_DIR}/tools/trace_check.cpp)
target_link_libraries(trace_check PRIVATE nlohmann_json::nlohmann_json)
set(_runs bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/trainer_runs.sh $<TARGET_FILE:quilt_cli> $<TARGET_FILE:metrics_compare>
    ${QUILT_MPIEXEC} ${QUILT_MPIEXEC_FLAGS} --)
function(quilt_trainer_test name)
  add_test(NAME "trainer: ${name}" COMMAND ${_runs} ${ARGN})
  set_tests_properties("trainer: ${name}" PROPERTIES TIMEOUT 600 RUN_SERIAL TRUE
    ENVIRONMENT "OMP_NUM_THREADS=1;QUILT_COMM_TIMEOUT_S=120;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endfunction()
quilt_trainer_test("ddp 2 follows the one-rank loss curve" equivalence ddp2 2 --set distributed.strategy=ddp)
quilt_trainer_test("ddp 4 follows the one-rank loss curve" equivalence ddp4 4 --set distributed.strategy=ddp)
quilt_trainer_test("fsdp 2 follows the one-rank loss curve" equivalence fsdp2 2 --set distributed.strategy=fsdp2)
quilt_trainer_test("fsdp 2 syncing every micro-batch follows the one-rank loss curve" equivalence fsdp2sync 2
  --set distributed.strategy=fsdp2 --set distributed.defer_fsdp_grad_sync=false)
quilt_trainer_test("fsdp 2 keeping gathered blocks for backward follows the one-rank loss curve" equivalence fsdp2keep 2
  --set distributed.strategy=fsdp2 --set distributed.reshard_after_forward=false)
quilt_trainer_test("fsdp 2 x tp 2 keeping gathered blocks, selective AC, bf16, follows the one-rank bf16 curve"
  equivalence_bf16 fsdp2tp2keep 4 --set distributed.tp_size=2 --set distributed.reshard_after_forward=false
  --set distributed.activation_checkpointing=true --set distributed.activation_checkpointing_mode=selective)
quilt_trainer_test("fsdp 4 follows the one-rank loss curve" equivalence fsdp4 4 --set distributed.strategy=fsdp2)
quilt_trainer_test("fsdp 4 resharding to groups of 2 after forward follows the one-rank loss curve" equivalence fsdp4g2 4
  --set distributed.reshard_after_forward=2)
quilt_trainer_test("fsdp 2 x tp 2 reducing gradients in bf16 follows the one-rank bf16 curve" equivalence_bf16 fsdp2tp2rbf16 4
  --set distributed.tp_size=2 --set train.reduce_dtype=bfloat16)
quilt_trainer_test("hsdp 2x2 follows the one-rank loss curve" equivalence hsdp 4 --set distributed.strategy=fsdp2
  --set distributed.dp_replicate_size=2)
quilt_trainer_test("tp 2 follows the one-rank loss curve" equivalence tp2 2 --set distributed.tp_size=2)
quilt_trainer_test("tp 2 with sequence parallel follows the one-rank loss curve" equivalence tp2sp 2
  --set distributed.tp_size=2 --set distributed.sequence_parallel=true)
quilt_trainer_test("fsdp 2 x tp 2 follows the one-rank loss curve" equivalence fsdp2tp2 4 --set distributed.tp_size=2)
quilt_trainer_test("fsdp 2 x tp 2 in bf16 follows the one-rank bf16 loss curve" equivalence_bf16 fsdp2tp2bf16 4
  --set distributed.tp_size=2)
quilt_trainer_test("activation checkpointing follows the one-rank loss curve" equivalence ac 1
  --set distributed.activation_checkpointing=true)
quilt_trainer_test("selective activation checkpointing follows the one-rank loss curve" equivalence sac 1
  --set distributed.activation_checkpointing=true --set distributed.activation_checkpointing_mode=selective)
quilt_trainer_test("fsdp 2 x tp 2 with selective activation checkpointing follows the one-rank loss curve" equivalence
  sac4 4 --set distributed.tp_size=2 --set distributed.activation_checkpointing=true
  --set distributed.activation_checkpointing_mode=selective)
quilt_trainer_test("fsdp 2 with activation checkpointing follows the one-rank loss curve" equivalence fsdp2ac 2
  --set distributed.strategy=fsdp2 --set distributed.activation_checkpointing=true)
# Context parallelism: each comm type at cp 2 and 4, with fsdp, tp (and SP), AC, packed rows.
foreach(_cp ring all_gather a2a)
  quilt_trainer_test("cp 2 (${_cp}) follows the one-rank loss curve" equivalence cp2${_cp} 2
    --set distributed.cp_size=2 --set distributed.cp_comm_type=${_cp})
  quilt_trainer_test("cp 4 (${_cp}) follows the one-rank loss curve" equivalence_kv4 cp4${_cp} 4
    --set distributed.cp_size=4 --set distributed.cp_comm_type=${_cp})
endforeach()
quilt_trainer_test("fsdp 2 x cp 2 follows the one-rank loss curve" equivalence fsdp2cp2 4 --set distributed.cp_size=2)
quilt_trainer_test("tp 2 x cp 2 with sequence parallel follows the one-rank loss curve" equivalence tp2cp2 4
  --set distributed.cp_size=2 --set distributed.tp_size=2 --set distributed.sequence_parallel=true)
quilt_trainer_test("cp 2 (a2a) with selective activation checkpointing follows the one-rank loss curve" equivalence
  cp2sac 2 --set distributed.cp_size=2 --set distributed.cp_comm_type=a2a --set distributed.activation_checkpointing=true
  --set distributed.activation_checkpointing_mode=selective)
quilt_trainer_test("packed rows under cp 2 (ring) follow the packed one-rank curve" equivalence_packed cp2packed 2
  --set distributed.cp_size=2)
quilt_trainer_test("packed rows under fsdp 2 x cp 2 (all_gather) follow the packed one-rank curve" equivalence_packed
  fsdp2cp2packed 4 --set distributed.cp_size=2 --set distributed.cp_comm_type=all_gather)
quilt_trainer_test("packed rows under cp 4 (ring) follow the packed one-rank curve" equivalence_packed cp4packed 4
  --set distributed.cp_size=4)
quilt_trainer_test("packing: packed rows train with finite losses, fsdp 2 follows one rank, resume inside a document is bit for bit"
  packing)
quilt_trainer_test("the same layout twice gives bit-identical losses" determinism)
# train.device cuda: reported skipped (exit 77) where no GPU is usable, after checking that the
# run is refused naming the key.
quilt_trainer_test("cuda: one GPU follows the host's loss curve, f32 and bf16, and resumes its checkpoint" cuda)
set_tests_properties("trainer: cuda: one GPU follows the host's loss curve, f32 and bf16, and resumes its checkpoint"
  PROPERTIES SKIP_RETURN_CODE 77)
quilt_trainer_test("cuda: a GPU per rank (fsdp, ddp, tp, hsdp, pp, cp, ep over MPI; over NCCL with 2 GPUs) follows the host's curve"
  cuda_ranks)
set_tests_properties("trainer: cuda: a GPU per rank (fsdp, ddp, tp, hsdp, pp, cp, ep over MPI; over NCCL with 2 GPUs) follows the host's curve"
  PROPERTIES SKIP_RETURN_CODE 77)
quilt_trainer_test("10 steps equal 5 steps, resume, 5 more, bit for bit" resume)
quilt_trainer_test("a non-finite loss or gradient skips the step on every rank" nonfinite)
quilt_trainer_test("train.max_skipped_steps non-finite steps in a row stop the run; keep_last keeps the last good checkpoint"
  skip_limit)
quilt_trainer_test("fsdp 2: 10 steps equal 5 steps, resume, 5 more, bit for bit" resume_fsdp)
quilt_trainer_test("saved under fsdp 4, resumed under fsdp 2 x tp 2, the curve continues; HF export" reshard)
quilt_trainer_test("HF weights in, train.steps 0 export out, bit-identical under 1 rank, fsdp 4, fsdp 2 x tp 2, ddp 2; a contradicting field is named"
  pretrained)
quilt_trainer_test("fsdp 4 and fsdp 2 x tp 2 build the model without storage: each rank allocates only its shards" deferred_init)
# Mixed-precision choices a layout does not implement are refused, naming the key: ddp keeps
# module outputs in the compute dtype (fsdp2 honours train.output_dtype).
add_test(NAME "trainer: an output dtype ddp does not implement is refused, naming the key"
  COMMAND sh -c "out=$(\"$0\" train --config \"$1\" --set distributed.strategy=ddp --set train.param_dtype=bfloat16 --set train.output_dtype=float32 2>&1); rc=$?; echo \"$out\"; \
[ $rc -ne 0 ] && echo \"$out\" | grep -q 'train.output_dtype'"
  $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes/llama_tiny.yaml)
# A bad recipe stops `quilt train` before any rank does work, naming the key.
add_test(NAME "trainer: a bad value stops train before work, naming the key"
  COMMAND sh -c "out=$(\"$0\" train --config \"$1\" --set train.steps=abc 2>&1); rc=$?; echo \"$out\"; \
[ $rc -ne 0 ] && echo \"$out\" | grep -q 'train.steps' && ! echo \"$out\" | grep -q 'step: 1'"
  $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes/llama_tiny.yaml)
# Mixture of experts (recipes/moe_tiny.yaml, shrunk): every layout follows the one-rank curve.
quilt_trainer_test("moe: ep 2 follows the one-rank loss curve" moe_equivalence ep2 2 --set distributed.ep_size=2)
quilt_trainer_test("moe: ep 4 follows the one-rank loss curve" moe_equivalence ep4 4 --set distributed.ep_size=4)
quilt_trainer_test("moe: ep 2 x ep_shard 2 (experts FSDP-sharded) follows the one-rank loss curve" moe_equivalence
  ep2x2 4 --set distributed.ep_size=2)
quilt_trainer_test("moe: ep 2 with full AC keeping the routing follows the one-rank loss curve" moe_equivalence ep2ac 2
  --set distributed.ep_size=2 --set distributed.activation_checkpointing=true)
quilt_trainer_test("moe: fsdp 4 without ep follows the one-rank loss curve" moe_equivalence fsdp4 4)
quilt_trainer_test("moe: cp 2 follows the one-rank loss curve" moe_equivalence cp2 2 --set distributed.cp_size=2)
quilt_trainer_test("moe: ep 2 over cp 2 (experts split between the ranks of a sequence) follows the one-rank loss curve"
  moe_equivalence ep2cp2 2 --set distributed.cp_size=2 --set distributed.ep_size=2)
quilt_trainer_test("moe: fsdp 2 x cp 2 with ep 4 follows the one-rank loss curve" moe_equivalence fsdp2cp2ep4 4
  --set distributed.cp_size=2 --set distributed.ep_size=4)
quilt_trainer_test("moe: fsdp 2 x tp 2 with sequence parallel follows the one-rank loss curve" moe_equivalence tp2 4
  --set distributed.tp_size=2 --set distributed.sequence_parallel=true)
quilt_trainer_test("moe: HF export writes one tensor per expert, which loads back under ep 4 bit-identically" moe_export)
# The seed's MoE rules, refused before work and naming the keys (and the moe: section warned
# about without expert parallelism).
# quilt_rule_test(<kind> <recipe> <name> <expected text> <--set ...>): `config check` at world 4
# must refuse the recipe with the overrides, printing the text.
function(quilt_rule_test kind recipe name expect)
  add_test(NAME "trainer: ${kind} rule: ${name}"
    COMMAND sh -c "q=$0; r=$1; e=$2; shift 2; out=$(\"$q\" config check --config \"$r\" --world 4 \"$@\" 2>&1); rc=$?; \
echo \"$out\" | tail -3; [ $rc -ne 0 ] && echo \"$out\" | grep -qF \"$e\""
      $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes/${recipe} "${expect}" ${ARGN})
endfunction()
function(quilt_moe_rule_test name expect)
  quilt_rule_test(moe moe_tiny.yaml "${name}" "${expect}" ${ARGN})
endfunction()
function(quilt_pp_rule_test name expect)
  quilt_rule_test(pp llama_tiny.yaml "${name}" "${expect}" ${ARGN})
endfunction()
quilt_moe_rule_test("ep_size must divide dp * cp" "ep_size 3 does not divide dp_size * cp_size" --set distributed.ep_size=3)
quilt_moe_rule_test("num_experts must divide by ep_size" "model.num_experts 6 is not divisible by distributed.ep_size 4"
  --set model.num_experts=6 --set distributed.ep_size=4)
quilt_moe_rule_test("ddp refuses ep" "strategy ddp replicates the whole model" --set distributed.strategy=ddp
  --set distributed.ep_size=2)
quilt_moe_rule_test("megatron_fsdp refuses ep" "strategy megatron_fsdp does not support ep_size=2"
  --set distributed.strategy=megatron_fsdp --set distributed.ep_size=2)
quilt_moe_rule_test("ep needs an MoE model" "needs a mixture-of-experts model" --set model.num_experts=0
  --set distributed.ep_size=2)
add_test(NAME "trainer: moe rule: a moe: section without ep is warned about, naming the key"
  COMMAND sh -c "\"$0\" config check --config \"$1\" --world 4 --set distributed.moe.reshard_after_forward=true 2>&1 | \
grep -qF 'distributed.moe.reshard_after_forward is ignored: distributed.moe applies only with ep_size > 1'"
  $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes/moe_tiny.yaml)
quilt_trainer_test("moe: ep 2 x tp 2 with sequence parallel follows the one-rank loss curve" moe_equivalence ep2tp2 4
  --set distributed.ep_size=2 --set distributed.tp_size=2 --set distributed.sequence_parallel=true)
quilt_trainer_test("moe: ep 2 x ep_shard 2 with full AC in bf16 follows the one-rank bf16 curve" moe_equivalence_bf16
  ep2x2bf16 4 --set distributed.ep_size=2 --set distributed.activation_checkpointing=true)
quilt_trainer_test("moe: ep 2 x tp 2 in bf16 follows the one-rank bf16 curve" moe_equivalence_bf16 ep2tp2bf16 4
  --set distributed.ep_size=2 --set distributed.tp_size=2)
quilt_trainer_test("moe: saved under ep 2, resumed under ep 4, the curve continues" moe_resume)
# Failing together (tests/tools/fail_together.sh): an error on some ranks ends every rank within
# seconds (the collective timeout is set to 300 s), with the error as the last line printed.
function(quilt_fail_test name case np within)
  add_test(NAME "trainer: fails together: ${name}"
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/fail_together.sh $<TARGET_FILE:quilt_cli>
      ${QUILT_MPIEXEC} ${QUILT_MPIEXEC_FLAGS} -- ${case} ${np} ${within} ${ARGN})
  set_tests_properties("trainer: fails together: ${name}" PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE
    ENVIRONMENT "OMP_NUM_THREADS=1;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")
endfunction()
quilt_fail_test("an unwritable checkpoint.dir is named at start-up on every rank" checkpoint_dir 4 10
  "start-up checks failed on ranks 0-3: \\[checkpoint.dir\\] cannot create /proc/quilt-no-such-dir")
quilt_fail_test("an unwritable checkpoint.dir is named at start-up with one rank" checkpoint_dir 1 10
  "quilt: error: start-up checks failed: \\[checkpoint.dir\\] cannot create /proc/quilt-no-such-dir")
quilt_fail_test("an unwritable logging.dir is named at start-up" logging_dir 4 10
  "start-up checks failed on rank 0: \\[logging.dir\\] cannot create /proc/quilt-no-such-dir")
quilt_fail_test("one rank's truncated checkpoint shard stops every rank" shard_truncated 4 10
  "checkpoint load failed on rank" "rank-00002.safetensors")
quilt_fail_test("one rank's deleted checkpoint shard stops every rank" shard_deleted 4 10
  "checkpoint load failed on rank" "rank-00001.safetensors")
quilt_fail_test("a shifted chunk in the checkpoint index stops every rank" index_shifted 4 10
  "checkpoint load failed on rank" "rank-00002.safetensors")
quilt_fail_test("a full disk under rank 0's metrics.jsonl mid-run ends every rank" metrics_disk_full 4 10
  "\\[rank 0\\] quilt: error: \\[logging.dir\\] writing .*metrics.jsonl failed at step 1 \\(disk full\\?\\)")
quilt_fail_test("index metadata with trailing junk is refused, naming the field" step_junk 4 10
  "checkpoint load failed on ranks 0-3: \\[checkpoint\\] .*step_00000002: metadata 'trainer.step' must be an integer, got '2x'")
add_test(NAME "trainer: eval of a checkpoint that does not exist says so"
  COMMAND sh -c "out=$(\"$0\" eval --config \"$1\" --checkpoint /nonexistent/step_00000001 2>&1); rc=$?; echo \"$out\"; \
[ $rc -ne 0 ] && echo \"$out\" | grep -qF 'quilt: error: [eval] --checkpoint /nonexistent/step_00000001 does not exist'"
  $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes/llama_tiny.yaml)
add_test(NAME "trainer: a directory given as --config is named as one"
  COMMAND sh -c "out=$(\"$0\" train --config \"$1\" 2>&1); rc=$?; echo \"$out\"; \
[ $rc -ne 0 ] && echo \"$out\" | grep -qF \"[config] --config $1 is a directory\""
  $<TARGET_FILE:quilt_cli> ${PROJECT_SOURCE_DIR}/recipes)
# Pipeline parallelism: every schedule follows the one-rank curve (4 pipeline micro-batches of
# one sequence each), at pp 2 and pp 4, and pp 2 x fsdp 2.
foreach(schedule gpipe 1f1b interleaved1f1b dfs looped_bfs zero_bubble v_schedule)
  quilt_trainer_test("pp 2 ${schedule} follows the one-rank loss curve" equivalence pp2${schedule} 2
    --set distributed.pp_size=2 --set distributed.pipeline.pp_schedule=${schedule} --set train.micro_batch_size=4)
endforeach()
# Sends posted and left (QUILT_PP_SEND_THREADS=0) instead of each on its own thread.
quilt_trainer_test("pp 2 zero_bubble with sends left to MPI's progress follows the one-rank loss curve" equivalence
  pp2nothreads 2 --set distributed.pp_size=2 --set distributed.pipeline.pp_schedule=zero_bubble
  --set train.micro_batch_size=4)
set_tests_properties("trainer: pp 2 zero_bubble with sends left to MPI's progress follows the one-rank loss curve"
  PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=1;QUILT_COMM_TIMEOUT_S=120;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1;QUILT_PP_SEND_THREADS=0")
quilt_trainer_test("pp 2 1f1b scaling gradients in the schedule follows the one-rank loss curve" equivalence pp2scale 2
  --set distributed.pp_size=2 --set train.micro_batch_size=4 --set distributed.pipeline.scale_grads_in_schedule=true)
quilt_trainer_test("pp 4 1f1b follows the one-rank loss curve" equivalence_deep pp4 4
  --set distributed.pp_size=4 --set train.micro_batch_size=4)
quilt_trainer_test("pp 4 interleaved1f1b (8 stages) follows the one-rank loss curve" equivalence_deep pp4i 4
  --set distributed.pp_size=4 --set distributed.pipeline.pp_schedule=interleaved1f1b --set train.micro_batch_size=4)
quilt_trainer_test("pp 2 x fsdp 2 follows the one-rank loss curve" equivalence pp2fsdp2 4
  --set distributed.pp_size=2 --set train.micro_batch_size=2)
quilt_trainer_test("pp 2 x fsdp 2 zero_bubble follows the one-rank loss curve" equivalence pp2fsdp2zb 4
  --set distributed.pp_size=2 --set distributed.pipeline.pp_schedule=zero_bubble --set train.micro_batch_size=2)
quilt_trainer_test("pp 2 x tp 2 follows the one-rank loss curve" equivalence pp2tp2 4
  --set distributed.pp_size=2 --set distributed.tp_size=2 --set train.micro_batch_size=4)
quilt_trainer_test("pp 2 x tp 2 with sequence parallel, zero_bubble, follows the one-rank loss curve" equivalence
  pp2tp2sp 4 --set distributed.pp_size=2 --set distributed.tp_size=2 --set distributed.sequence_parallel=true
  --set distributed.pipeline.pp_schedule=zero_bubble --set train.micro_batch_size=4)
quilt_trainer_test("pp 2 x dp 2 x tp 2 (8 ranks) follows the one-rank loss curve" equivalence pp2dp2tp2 8
  --set distributed.pp_size=2 --set distributed.tp_size=2 --set train.micro_batch_size=2)
quilt_trainer_test("pp 2 zero_bubble with activation checkpointing follows the one-rank loss curve" equivalence pp2ac 2
  --set distributed.pp_size=2 --set distributed.activation_checkpointing=true
  --set distributed.pipeline.pp_schedule=zero_bubble --set train.micro_batch_size=4)
quilt_trainer_test("pp 2: 10 steps equal 5 steps, resume, 5 more, bit for bit; the pp 2 checkpoint resumes at 1 rank and fsdp 4"
  resume_pp)

# rank's 4 forwards and 4 backwards (1f1b) or 4 F, 4 I and 4 W (zero_bubble) as slices.
quilt_trainer_test("logging.trace writes a Perfetto trace of a pp 2 1f1b step" pp_trace 1f1b 8)
quilt_trainer_test("logging.trace writes a Perfetto trace of a pp 2 zero_bubble step (2 stages per rank)" pp_trace zero_bubble 24)
# The pipeline's rules, refused before work and naming the keys.
quilt_pp_rule_test("pp_size must divide the world" "pp_size" --set distributed.pp_size=3)
quilt_pp_rule_test("a schedule not in the list" "distributed.pipeline.pp_schedule" --set distributed.pp_size=2
  --set distributed.pipeline.pp_schedule=zigzag)
quilt_pp_rule_test("fewer layers than stages" "distributed.pp_size 4 exceeds model.num_hidden_layers 2"
  --set distributed.pp_size=4 --set model.num_hidden_layers=2)
quilt_pp_rule_test("too few micro-batches for interleaved1f1b"
  "interleaved1f1b at pp 2 needs a micro-batch count that is a multiple of pp" --set distributed.pp_size=2
  --set distributed.pipeline.pp_schedule=interleaved1f1b --set train.micro_batch_size=3 --set train.global_batch_size=6)
quilt_pp_rule_test("ddp refuses pp" "strategy ddp replicates the whole model on every rank and cannot combine with pp_size=2" --set distributed.pp_size=2
  --set distributed.strategy=ddp)
# Context parallelism's rules, refused by `config check` at world 4 naming the keys.
quilt_rule_test(cp llama_tiny.yaml "a2a needs heads and kv heads cp can cut"
  "distributed.cp_comm_type a2a cuts the heads over cp_size 4" --set distributed.cp_size=4
  --set distributed.cp_comm_type=a2a)
quilt_rule_test(cp llama_tiny.yaml "an unknown cp_comm_type" "distributed.cp_comm_type" --set distributed.cp_size=2
  --set distributed.cp_comm_type=ulysses)
quilt_rule_test(cp llama_tiny.yaml "a packed document multiple cp cannot cut"
  "packed_sequence.document_multiple 6 is not a multiple of 2 * cp_size = 8" --set distributed.cp_size=4
  --set packed_sequence.packed_sequence_size=128 --set train.micro_batch_size=1 --set packed_sequence.document_multiple=6)
