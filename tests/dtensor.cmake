# Multi-rank dtensor tests under mpiexec (included by tests/CMakeLists.txt after mpi.cmake):
# redistribute round-trips at 4 and 8 ranks on 1-D and 2-D meshes, a checkpoint saved at 4
# ranks and loaded at 2 and 8 ranks and into a 2-D mesh, and a rank killed mid-save.
add_executable(dtensor_mpi dtensor/mpi_prog.cpp)
target_link_libraries(dtensor_mpi PRIVATE quilt::quilt quilt_flags)
target_include_directories(dtensor_mpi PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/..)

quilt_mpi_test("dtensor: redistribute round-trips on 4 ranks" NP 4 COMMAND $<TARGET_FILE:dtensor_mpi> redistribute)
quilt_mpi_test("dtensor: redistribute round-trips on 8 ranks" NP 8 COMMAND $<TARGET_FILE:dtensor_mpi> redistribute)

# Save once at 4 ranks (a fixture), then load at other world sizes and layouts.
set(_dt_ckpt ${CMAKE_CURRENT_BINARY_DIR}/dtensor_ckpt)
quilt_mpi_test("dtensor: checkpoint saved at 4 ranks" NP 4 COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-save ${_dt_ckpt})
quilt_mpi_test("dtensor: checkpoint from 4 ranks loads at 2 ranks" NP 2
  COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-load ${_dt_ckpt} 2)
quilt_mpi_test("dtensor: checkpoint from 4 ranks loads at 8 ranks" NP 8
  COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-load ${_dt_ckpt} 8)
quilt_mpi_test("dtensor: checkpoint from 4 ranks loads into a 2x4 mesh" NP 8
  COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-load ${_dt_ckpt} 2x4)
set_tests_properties("dtensor: checkpoint saved at 4 ranks" PROPERTIES FIXTURES_SETUP dtensor_ckpt)
set_tests_properties("dtensor: checkpoint from 4 ranks loads at 2 ranks"
  "dtensor: checkpoint from 4 ranks loads at 8 ranks" "dtensor: checkpoint from 4 ranks loads into a 2x4 mesh"
  PROPERTIES FIXTURES_REQUIRED dtensor_ckpt)

# A rank killed with SIGKILL half-way through writing its shard: the job fails, and the previous
# checkpoint is still the latest complete one.
set(_dt_crash ${CMAKE_CURRENT_BINARY_DIR}/dtensor_ckpt_crash)
quilt_mpi_test("dtensor: a rank killed mid-save ends the job" NP 4
  COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-crash ${_dt_crash}
  TIMEOUT 120 WITHIN 60 EXPECT_FAIL "saved step-1" "signal 9|Killed")
quilt_mpi_test("dtensor: after a killed save the previous checkpoint is the latest complete one" NP 2
  COMMAND $<TARGET_FILE:dtensor_mpi> ckpt-verify-crash ${_dt_crash})
set_tests_properties("dtensor: a rank killed mid-save ends the job" PROPERTIES FIXTURES_SETUP dtensor_crash)
set_tests_properties("dtensor: after a killed save the previous checkpoint is the latest complete one"
  PROPERTIES FIXTURES_REQUIRED dtensor_crash)
