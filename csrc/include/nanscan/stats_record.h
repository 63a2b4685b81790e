// stats_record.h: the layout of one tensor's statistics record, shared by the CPU and CUDA kernels and Python.
//
// NOTE: [stats record]
// A record is kRecordWidth int64 slots. Counts are exact integers, so merging partial records (threads, chunks,
// blocks) is order-independent and deterministic. absmax/absmin hold the *raw abs bit pattern* of the tensor's own
// format: for non-negative finite IEEE values integer order equals numeric order, so max/min (and CUDA's integer
// atomicMax/atomicMin) on the bits is exact; Python turns them into doubles once. kAbsMinNone means "no finite
// non-zero value". sumsq holds the bits of a double (the only slot whose merge order can change the last bits).
// Python mirrors these constants in nanscan/engine/_layout.py; a test checks that they agree.
#pragma once

#include <cstdint>

namespace nanscan {
namespace record {
constexpr int kNaN = 0;
constexpr int kPosInf = 1;
constexpr int kNegInf = 2;
constexpr int kZero = 3;
constexpr int kSubnormal = 4;
constexpr int kAbsMaxBits = 5;
constexpr int kAbsMinBits = 6;
constexpr int kSumSq = 7;
constexpr int kHist = 8;
constexpr int kWidth = kHist + 256;
constexpr int64_t kAbsMinNone = INT64_MAX;
}  // namespace record
}  // namespace nanscan
