// Transport over MPI. Initialises MPI (MPI_THREAD_MULTIPLE requested) unless somebody
// (mpi4py) already did; works on private duplicates of MPI_COMM_WORLD so its traffic
// never mixes with the application's.
#pragma once

#include <memory>

#include "transport.h"

namespace tnt {

// Must be called on the thread that will own all MPI calls. Throws CommError.
std::unique_ptr<ControlPlane> make_mpi_control();

}  // namespace tnt
