// __dp4a for numba-cuda: a signed 4 x int8 dot product plus an int32 accumulator, one instruction.
// numba's calling convention for a linked device function: the result goes through *ret, return 0.
extern "C" __device__ int dp4a_s8(int* ret, int a, int b, int c) { *ret = __dp4a(a, b, c); return 0; }
