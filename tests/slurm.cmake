# Launch and observability tests: srun and sbatch under a one-node Slurm cluster on this host
# (tools/slurm-local.sh installs slurm-wlm and munge when missing, starts the daemons and stops
# them when the test ends, also on failure), traces, TensorBoard events, plots and progress
# lines (tests/tools/observe_runs.sh). Labelled "launch": they run no GEMM of their own, so the
# Makefile's passes with each GEMM library forced leave them out (ctest -LE launch).
if(NOT TARGET quilt_cli)
  return()
endif()
add_executable(tfevents_check ${CMAKE_CURRENT_SOURCE_DIR}/tools/tfevents_check.cpp)
target_link_libraries(tfevents_check PRIVATE nlohmann_json::nlohmann_json)
set(_quilt_launch_env "OMP_NUM_THREADS=1;QUILT_COMM_TIMEOUT_S=120;OMPI_ALLOW_RUN_AS_ROOT=1;OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1")

# The Slurm tests share one cluster (its ports and state directory): they run one at a time.
function(quilt_slurm_test name mode)
  add_test(NAME "slurm: ${name}"
    COMMAND bash ${PROJECT_SOURCE_DIR}/tools/slurm-local.sh run --
      bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/slurm_runs.sh $<TARGET_FILE:quilt_cli> $<TARGET_FILE:metrics_compare>
      ${QUILT_MPIEXEC} ${QUILT_MPIEXEC_FLAGS} -- ${mode})
  set_tests_properties("slurm: ${name}" PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE LABELS launch SKIP_RETURN_CODE 77
    ENVIRONMENT "${_quilt_launch_env};QUILT_SLURM_DIR=${CMAKE_BINARY_DIR}/slurm-local")
endfunction()
quilt_slurm_test("srun --mpi=pmix -n 4 prints the same losses as mpiexec -n 4, ranks from Slurm's environment" losses)
quilt_slurm_test("sbatch recipes/slurm/train.sbatch runs to completion" sbatch)
quilt_slurm_test("srun -n 4 with rank 2 killed by SIGKILL mid-run ends in under 60 s, non-zero, task 2 named" killed)

function(quilt_observe_test name mode)
  add_test(NAME "observe: ${name}"
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/tools/observe_runs.sh $<TARGET_FILE:quilt_cli>
      $<TARGET_FILE_DIR:tfevents_check> ${QUILT_MPIEXEC} ${QUILT_MPIEXEC_FLAGS} -- ${mode})
  set_tests_properties("observe: ${name}" PROPERTIES TIMEOUT 300 RUN_SERIAL TRUE LABELS launch
    ENVIRONMENT "${_quilt_launch_env}")
endfunction()
quilt_observe_test("logging.trace writes per-rank and merged traces of ops, collectives, FSDP, data and optimizer" trace)
quilt_observe_test("logging.tensorboard writes an events file whose records and CRCs read back" tensorboard)
quilt_observe_test("quilt plot draws one and two runs; a missing file or a non-JSON line is named" plot)
quilt_observe_test("data prepare shows progress; step lines carry elapsed and ETA; the start-up report" progress)
