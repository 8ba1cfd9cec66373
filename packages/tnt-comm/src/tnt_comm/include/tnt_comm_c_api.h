/* tnt_comm's C interface, for native code in other packages (tarantella's TensorFlow ops).
 *
 * Why C: an op library built against TensorFlow must not link tnt_comm's Python module
 * or share its C++ ABI. It includes only this header and receives the function table at
 * run time (tnt_comm.c_api_address()), so the two builds never see each other's symbols.
 *
 * Handles are the ids of tnt_comm.Communicator.native_handle() and
 * tnt_comm.FusedAllreduce.native_handle(): an id whose object is gone is an error, never a
 * dangling pointer. Every call blocks the calling thread (never the GIL: it takes none) and
 * returns TNT_OK or an error code with a message in err[0..err_len). After
 * TNT_ERR_STALL the ranks are out of step and MPI may still touch the memory of the failed
 * call: the caller must keep it alive (leak it), as tnt_comm's Python layer does.
 */
#ifndef TNT_COMM_C_API_H_
#define TNT_COMM_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TNT_COMM_C_API_VERSION 3

enum tnt_status {
  TNT_OK = 0,
  TNT_ERR_COMM = 1,    /* tnt_comm.CommError: MPI failed, ranks out of step, engine closed */
  TNT_ERR_STALL = 2,   /* tnt_comm.StallError: a rank did not arrive within TNT_COMM_TIMEOUT */
  TNT_ERR_ARG = 3,     /* bad arguments (unknown handle, dtype, sizes) */
  TNT_ERR_OTHER = 4
};

/* dtype: numpy's name ("float32", "bfloat16", "int64", ...). op: tnt_comm.Op's value. */
typedef struct tnt_comm_c_api {
  int32_t version;     /* TNT_COMM_C_API_VERSION */
  int32_t struct_size; /* sizeof(tnt_comm_c_api) */

  /* out = op over the communicator's ranks of in (count elements; in == out allowed).
   * Checked like tnt_comm.Communicator.allreduce: ranks that disagree on dtype, shape or
   * op get an error naming every rank's arguments. */
  int (*allreduce)(int64_t comm, const void* in, void* out, const int64_t* shape, int32_t ndim,
                   const char* dtype, int32_t op, char* err, size_t err_len);
  /* out = every rank's in (same shape on all ranks), concatenated along axis 0 in rank
   * order; out holds size * (bytes of in). */
  int (*allgather)(int64_t comm, const void* in, void* out, const int64_t* shape, int32_t ndim,
                   const char* dtype, char* err, size_t err_len);
  /* tnt_comm.FusedAllreduce.submit_many: copies n tensors (data[k] NULL: zeros) into their
   * bucket slots; launches the buckets that became ready. Never waits on communication. */
  int (*fused_submit)(int64_t engine, int64_t n, const int64_t* indices, const void* const* data,
                      char* err, size_t err_len);
  /* tnt_comm.FusedAllreduce.wait_buckets: waits for every bucket of the round and copies
   * bucket b's reduced bytes (back to back, slot padding included) into out[b], which holds
   * capacity[b] bytes. n must equal the plan's bucket count. */
  int (*fused_wait_buckets)(int64_t engine, int64_t n, void* const* out, const int64_t* capacity,
                            char* err, size_t err_len);
  /* Version 2. As fused_wait_buckets, without the copy: out[b] receives the address of
   * bucket b's reduced bytes inside the engine (64-byte aligned, nbytes[b] long) and hold[b]
   * a reference that keeps them alive and untouched until fused_release(hold[b]). While a
   * hold exists, the engine reduces that bucket's next rounds in a fresh buffer, so a
   * holder never sees its bytes change (memory, not correctness, is the price of holding
   * on). Release each hold once, from any thread; nothing is held when the call fails. */
  int (*fused_wait_buckets_borrow)(int64_t engine, int64_t n, void** out, int64_t* nbytes,
                                   void** hold, char* err, size_t err_len);
  void (*fused_release)(void* hold);
  /* Version 3. One bucket of the round, borrowed as by fused_wait_buckets_borrow: blocks
   * until bucket `bucket` (plan order) is reduced, while later buckets may still be
   * submitted or on the wire. Each bucket once per round; the round re-arms once every
   * bucket was taken. Do not mix with fused_wait_buckets* within a round. */
  int (*fused_wait_bucket_borrow)(int64_t engine, int64_t bucket, void** out, int64_t* nbytes,
                                  void** hold, char* err, size_t err_len);
} tnt_comm_c_api;

#ifdef __cplusplus
}
#endif

#endif /* TNT_COMM_C_API_H_ */
