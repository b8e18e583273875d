"""The Triton kernel behind kernels.wna16.matmul (imported only when it is launched; layout there)."""

import triton
import triton.language as tl


@triton.jit
def wna16_kernel(x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, group_size, k_per_split,
                 BITS: tl.constexpr, HAS_ZERO: tl.constexpr, ATOMIC: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_in_tile = tl.arange(0, BLOCK_K // PER_WORD)
    shifts = tl.arange(0, PER_WORD) * BITS
    word_rows = tl.cdiv(K, PER_WORD)
    m_ok = offs_m[:, None] < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok & (offs_k[None, :] < K),
                    other=0.0)
        rows = k0 // PER_WORD + rows_in_tile
        words = tl.load(w_ptr + rows[:, None] * N + offs_n[None, :], mask=(rows[:, None] < word_rows) & n_ok[None, :],
                        other=0)
        q = (words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
        q = tl.reshape(q, (BLOCK_K, BLOCK_N))
        group = k0 // group_size  # the whole tile lies in this group
        scale = tl.load(s_ptr + group * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + group * N + offs_n, mask=n_ok, other=0).to(tl.int32) + OFFSET
            w = (q - zero[None, :]).to(x.dtype)
        else:
            w = (q - OFFSET).to(x.dtype)
        acc += tl.dot(x, w, out_dtype=tl.float32) * scale[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = m_ok & n_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
