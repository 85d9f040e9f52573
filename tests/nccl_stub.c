/*
 * nccl_stub.c: a stand-in libnccl.so.2 of release STUB_VERSION (an NCCL_VERSION_CODE), for
 * python/tests/test_nccl_load.py: it has every function src/nccl.c loads; ncclGetVersion says
 * STUB_VERSION and ncclGetUniqueId gives 128 bytes of 0x2a; every other call fails.
 */
#include <string.h>

typedef struct stub_team { int nRanks, rank, stride; } stub_team;

int ncclGetVersion(int *v) { *v = STUB_VERSION; return 0; }
int ncclGetUniqueId(void *id) { memset(id, 0x2a, 128); return 0; }
const char *ncclGetErrorString(int r) { (void)r; return "a stand-in NCCL"; }
const char *ncclGetLastError(void *comm) { (void)comm; return ""; }
stub_team ncclTeamLsa(void *comm) { (void)comm; return (stub_team){0, 0, 0}; }
#define FAILS(name) int name(void) { return 1; }
FAILS(ncclCommInitRank) FAILS(ncclCommDestroy) FAILS(ncclCommCount) FAILS(ncclCommUserRank)
FAILS(ncclCommCuDevice) FAILS(ncclMemAlloc) FAILS(ncclMemFree) FAILS(ncclCommWindowRegister)
FAILS(ncclCommWindowDeregister) FAILS(ncclAllGather)
