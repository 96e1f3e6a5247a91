// MoePermute for the Ascend AI Core vector unit (AscendC): y[i] = x[idx[i]], a zero row where
// idx[i] == -1. Same contract as MoePermute in kernels/cpu/moe_dispatch.cc.
//
// UNTESTED: written from the public AscendC programming-guide patterns (TPipe/TQue,
// CopyIn -> Compute -> CopyOut, double buffering) on a machine without Ascend hardware or
// CANN; it has never been compiled. See README.md in this folder for how to build it.
//
// Inputs:  x   [T, H]  float16 / float32 / bfloat16 (DTYPE_X, set by the msopgen build)
//          idx [N]     int32, each in [-1, T)
// Output:  y   [N, H]
// Tiling (host side, see README): numRows = N, hidden = H, numTokens = T.
// Requires H * sizeof(DTYPE_X) to be a multiple of 32 bytes (DataCopy moves 32-byte blocks);
// unaligned H would need DataCopyPad.
#include "kernel_operator.h"

using namespace AscendC;

namespace {

constexpr int32_t BUFFER_NUM = 2;                // double buffering: row i+1 loads while row i stores
constexpr uint32_t MAX_CHUNK_BYTES = 16 * 1024;  // one UB buffer; longer rows move in chunks

__aicore__ inline uint32_t MinU32(uint32_t a, uint32_t b) { return a < b ? a : b; }

}  // namespace

template <typename T>
class KernelPermute {
public:
    __aicore__ inline KernelPermute() {}

    __aicore__ inline void Init(GM_ADDR x, GM_ADDR idx, GM_ADDR y, uint32_t numRows,
                                uint32_t hidden, uint32_t numTokens)
    {
        // Step 1: this core owns output rows [rowStart, rowStart + rowCount).
        const uint32_t perCore = (numRows + GetBlockNum() - 1) / GetBlockNum();
        const uint32_t rowStart = MinU32(perCore * GetBlockIdx(), numRows);
        this->rowCount = MinU32(perCore, numRows - rowStart);
        this->hidden = hidden;
        this->chunk = MinU32(hidden, MAX_CHUNK_BYTES / sizeof(T));

        // Step 2: x is read anywhere (rows come from the index); idx and y only in our range.
        xGm.SetGlobalBuffer((__gm__ T *)x, (uint64_t)numTokens * hidden);
        idxGm.SetGlobalBuffer((__gm__ int32_t *)idx + rowStart, this->rowCount);
        yGm.SetGlobalBuffer((__gm__ T *)y + (uint64_t)rowStart * hidden,
                            (uint64_t)this->rowCount * hidden);
        pipe.InitBuffer(inQueue, BUFFER_NUM, this->chunk * sizeof(T));
        pipe.InitBuffer(outQueue, BUFFER_NUM, this->chunk * sizeof(T));
    }

    __aicore__ inline void Process()
    {
        for (uint32_t row = 0; row < rowCount; ++row) {
            // A scalar read through the data cache; staging a tile of indices in UB would save
            // a round trip per row.
            const int32_t src = idxGm.GetValue(row);
            for (uint32_t offset = 0; offset < hidden; offset += chunk) {
                const uint32_t len = MinU32(chunk, hidden - offset);
                CopyIn(src, offset, len);
                Compute(src, len);
                CopyOut(row, offset, len);
            }
        }
    }

private:
    // GM -> UB: the source row's chunk (nothing to load for a -1 row).
    __aicore__ inline void CopyIn(int32_t src, uint32_t offset, uint32_t len)
    {
        LocalTensor<T> xLocal = inQueue.AllocTensor<T>();
        if (src >= 0) {
            DataCopy(xLocal, xGm[(uint64_t)src * hidden + offset], len);
        }
        inQueue.EnQue(xLocal);
    }

    // UB -> UB: copy the row, or write zeros for a -1 row.
    __aicore__ inline void Compute(int32_t src, uint32_t len)
    {
        LocalTensor<T> xLocal = inQueue.DeQue<T>();
        LocalTensor<T> yLocal = outQueue.AllocTensor<T>();
        if (src >= 0) {
            DataCopy(yLocal, xLocal, len);
        } else {
            Duplicate(yLocal, static_cast<T>(0), len);
        }
        outQueue.EnQue(yLocal);
        inQueue.FreeTensor(xLocal);
    }

    // UB -> GM: output row `row` (relative to this core's range).
    __aicore__ inline void CopyOut(uint32_t row, uint32_t offset, uint32_t len)
    {
        LocalTensor<T> yLocal = outQueue.DeQue<T>();
        DataCopy(yGm[(uint64_t)row * hidden + offset], yLocal, len);
        outQueue.FreeTensor(yLocal);
    }

    TPipe pipe;
    TQue<QuePosition::VECIN, BUFFER_NUM> inQueue;
    TQue<QuePosition::VECOUT, BUFFER_NUM> outQueue;
    GlobalTensor<T> xGm;
    GlobalTensor<int32_t> idxGm;
    GlobalTensor<T> yGm;
    uint32_t rowCount = 0;
    uint32_t hidden = 0;
    uint32_t chunk = 0;
};

extern "C" __global__ __aicore__ void moe_permute(GM_ADDR x, GM_ADDR idx, GM_ADDR y,
                                                  GM_ADDR workspace, GM_ADDR tiling)
{
    GET_TILING_DATA(tilingData, tiling);
    KernelPermute<DTYPE_X> op;
    op.Init(x, idx, y, tilingData.numRows, tilingData.hidden, tilingData.numTokens);
    op.Process();
}
