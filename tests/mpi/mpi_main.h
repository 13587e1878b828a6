// The MPI runtime for tests under mpirun: one per process, created in main().
#pragma once

#include "loom/comm/mpi/mpi_process_group.h"

namespace loom::test {
MpiRuntime& runtime();
}
