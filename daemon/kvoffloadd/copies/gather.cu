// Gather/scatter copy kernel for the daemon's GPU lanes (kvoffloadd.copies.gather).
//
// One launch copies a list of tiles, each (dst, src, nbytes), between an engine's KV
// cache (device memory, imported by CUDA IPC) and the region (pinned host memory the
// GPU reaches through unified addressing). A warp copies one tile at a time, all warps
// of the grid striding over the tile list; 16-byte aligned tiles move as 16-byte
// words, UNROLL loads in flight per lane before the stores (host memory is far: many
// loads must be outstanding to fill the link), 4-byte aligned ones as words, anything
// else byte by byte (the daemon sends only 16-byte aligned tiles; the others keep the
// kernel correct whatever it is given). Streaming loads and stores (.cs) keep copied
// KV from evicting the engine's working set in L2.
//
// Built with tools/build-ptx into gather.ptx (PTX for sm_80 and later, shipped with
// the package and compiled by the driver at load): the daemon needs no CUDA toolkit.

struct Tile {
  unsigned long long dst;
  unsigned long long src;
  unsigned long long nbytes;
};

template <typename T, int UNROLL>
__device__ __forceinline__ void copy_words(char* dst, const char* src, unsigned long long n,
                                           unsigned lane) {
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const unsigned long long words = n / sizeof(T);
  unsigned long long i = lane;
  for (; i + (UNROLL - 1) * 32 < words; i += UNROLL * 32) {
    T v[UNROLL];
#pragma unroll
    for (int k = 0; k < UNROLL; k++) v[k] = __ldcs(s + i + k * 32);
#pragma unroll
    for (int k = 0; k < UNROLL; k++) __stcs(d + i + k * 32, v[k]);
  }
  for (; i < words; i += 32) __stcs(d + i, __ldcs(s + i));
}

extern "C" __global__ void __launch_bounds__(256)
    kvo_gather(const Tile* __restrict__ tiles, unsigned long long num_tiles) {
  const unsigned lane = threadIdx.x & 31;
  const unsigned long long warps = (gridDim.x * (unsigned long long)blockDim.x) >> 5;
  unsigned long long w = (blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x) >> 5;
  for (; w < num_tiles; w += warps) {
    const Tile t = tiles[w];
    char* d = reinterpret_cast<char*>(t.dst);
    const char* s = reinterpret_cast<const char*>(t.src);
    const unsigned long long bits = t.dst | t.src | t.nbytes;
    if ((bits & 15) == 0) {
      copy_words<uint4, 8>(d, s, t.nbytes, lane);
    } else if ((bits & 3) == 0) {
      copy_words<unsigned, 4>(d, s, t.nbytes, lane);
    } else {
      for (unsigned long long i = lane; i < t.nbytes; i += 32) d[i] = s[i];
    }
  }
}
