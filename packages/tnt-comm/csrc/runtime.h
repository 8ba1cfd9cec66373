// The process-wide engine behind tnt_comm.init()/finalize(): created lazily by the
// first call that needs it, finalised once (MPI cannot be restarted in a process).
#pragma once

#include "engine.h"

namespace tnt {

Engine& runtime_engine();  // init() if needed; throws CommError after finalize()
void runtime_init();
void runtime_finalize();
bool runtime_is_initialized();
[[noreturn]] void runtime_abort(int code);

}  // namespace tnt
