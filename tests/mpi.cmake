# Multi-rank tests under mpiexec (included by tests/CMakeLists.txt).
#
#   quilt_mpi_test(<name> NP <n> COMMAND <exe> [args...] [TIMEOUT <s>] [ENV VAR=value...]
#                  [EXPECT_FAIL <regex>... WITHIN <s>])
#
# registers a ctest that runs the command on <n> ranks with the flags this kind of machine
# needs (Open MPI, possibly as root, oversubscribed: ranks yield instead of spinning). With
# EXPECT_FAIL the job must exit non-zero within WITHIN seconds, print a line matching every
# regex and leave no process behind (tests/collectives/expect_fail.sh).

find_program(QUILT_MPIEXEC NAMES mpiexec mpirun HINTS ${MPIEXEC_EXECUTABLE} REQUIRED)
execute_process(COMMAND ${QUILT_MPIEXEC} --version OUTPUT_VARIABLE _quilt_mpiexec_version ERROR_QUIET)
if(_quilt_mpiexec_version MATCHES "Open MPI|OpenRTE")
  set(QUILT_MPIEXEC_FLAGS --allow-run-as-root --oversubscribe --bind-to none
      --mca btl vader,self --mca pml ob1 --mca mpi_yield_when_idle 1)
else()
  set(QUILT_MPIEXEC_FLAGS)
endif()
# Every multi-rank test gets these: one OpenMP thread per rank (ranks already oversubscribe the
# cores) and a collective timeout short enough that a bug fails the test instead of hanging CI.
set(QUILT_MPI_TEST_ENV "OMP_NUM_THREADS=1;QUILT_COMM_TIMEOUT_S=120")

function(quilt_mpi_test name)
  cmake_parse_arguments(ARG "" "NP;TIMEOUT;WITHIN" "COMMAND;EXPECT_FAIL;ENV" ${ARGN})
  if(NOT ARG_NP OR NOT ARG_COMMAND)
    message(FATAL_ERROR "quilt_mpi_test(${name}): NP and COMMAND are required")
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  set(cmd ${QUILT_MPIEXEC} ${QUILT_MPIEXEC_FLAGS} -n ${ARG_NP} ${ARG_COMMAND})
  if(ARG_EXPECT_FAIL)
    if(NOT ARG_WITHIN)
      message(FATAL_ERROR "quilt_mpi_test(${name}): EXPECT_FAIL needs WITHIN <seconds>")
    endif()
    set(cmd bash ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/collectives/expect_fail.sh ${ARG_WITHIN} ${ARG_EXPECT_FAIL} -- ${cmd})
  endif()
  add_test(NAME ${name} COMMAND ${cmd})
  # The ranks need the whole (small) machine: keep ctest from running other tests beside them,
  # so timing-based checks stay meaningful.
  set(procs ${ARG_NP})
  if(procs GREATER 2)
    set(procs 2)
  endif()
  set(env ${QUILT_MPI_TEST_ENV} ${ARG_ENV})  # later entries win
  set_tests_properties(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} PROCESSORS ${procs} ENVIRONMENT "${env}")
endfunction()

# ---- collectives -------------------------------------------------------------
# quilt_collectives_suite (the shared correctness suite) is defined in tests/CMakeLists.txt.

add_executable(collectives_mpi_suite collectives/mpi_suite.cpp)
target_link_libraries(collectives_mpi_suite PRIVATE quilt_collectives_suite quilt_flags)
add_executable(collectives_fault collectives/fault_prog.cpp)
target_link_libraries(collectives_fault PRIVATE quilt::quilt quilt_flags)

# The "large" size shrinks with the rank count so 8 oversubscribed ranks stay quick.
quilt_mpi_test("collectives: MPI suite on 2 ranks" NP 2 COMMAND $<TARGET_FILE:collectives_mpi_suite> --large 262147)
quilt_mpi_test("collectives: MPI suite on 3 ranks with debug checks" NP 3
  COMMAND $<TARGET_FILE:collectives_mpi_suite> --large 100003 --debug)
quilt_mpi_test("collectives: MPI suite on 4 ranks" NP 4 COMMAND $<TARGET_FILE:collectives_mpi_suite> --large 65537)
quilt_mpi_test("collectives: MPI suite on 8 ranks" NP 8 COMMAND $<TARGET_FILE:collectives_mpi_suite> --large 20011)
quilt_mpi_test("collectives: MPI suite on 3 ranks without MPI_THREAD_MULTIPLE" NP 3
  COMMAND $<TARGET_FILE:collectives_mpi_suite> --large 5003 ENV QUILT_MPI_THREAD_LEVEL=serialized)

# Faults: the watchdog timeout is 3 s, so every job must be gone well within timeout + 10 s.
set(_fault ENV QUILT_COMM_TIMEOUT_S=3 TIMEOUT 60 WITHIN 13)
quilt_mpi_test("collectives: a rank that skips a collective aborts the job naming it" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> skip ${_fault}
  EXPECT_FAIL "\\[watchdog\\] all_reduce #5 on world \\(shape \\(4,\\), f32, sum"
              "ranks that had not arrived: 2 \\(last started all_reduce #4")
quilt_mpi_test("collectives: a synchronous recv that is never matched makes the watchdog abort the job naming it" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> unmatched_recv ${_fault}
  EXPECT_FAIL "\\[watchdog\\] recv p2p#1 on world \\(shape \\(3,\\), f32, from rank 2, tag 5, rank 0\\) did not complete")
quilt_mpi_test("collectives: a rank killed with SIGKILL ends the job" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> sigkill ${_fault}
  EXPECT_FAIL "signal 9|Killed")
quilt_mpi_test("collectives: a stopped rank makes the watchdog abort the job" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> sigstop ${_fault}
  EXPECT_FAIL "\\[watchdog\\] all_reduce #3 on world"
              "ranks that had not arrived: 2 \\(did not answer")
# An error on one rank ends every rank at once (a failure notice, well before the 60 s
# watchdog), its text the last line: printed by that rank and, relayed, by rank 0.
set(_throw ENV QUILT_COMM_TIMEOUT_S=60 TIMEOUT 60 WITHIN 8)
quilt_mpi_test("collectives: an error on one rank ends every rank at once with its message" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> throw ${_throw}
  EXPECT_FAIL "\\[rank 2\\] quilt: error: \\[fault\\] rank 2 cannot go on"
              "\\[rank 0\\] quilt: error: rank 2 failed: \\[fault\\] rank 2 cannot go on")
quilt_mpi_test("collectives: without MPI_THREAD_MULTIPLE an error on one rank aborts the job with its message" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> throw
  ENV QUILT_COMM_TIMEOUT_S=60 QUILT_MPI_THREAD_LEVEL=serialized TIMEOUT 60 WITHIN 8
  EXPECT_FAIL "\\[rank 2\\] quilt: error: \\[fault\\] rank 2 cannot go on")
quilt_mpi_test("collectives: a shape mismatch in debug mode names the rank" NP 3
  COMMAND $<TARGET_FILE:collectives_fault> mismatch ${_fault}
  EXPECT_FAIL "rank 2 calls all_reduce #3 with shape \\(5,\\), f32, sum but rank 0 calls all_reduce #3 with shape \\(4,\\)")
