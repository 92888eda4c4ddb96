"""qmm_profile.py's readers of Nsight Compute output, on excerpts of a real H200 report
(the profiling itself needs the GPU machine)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts" / "bench"))

import qmm_profile  # noqa: E402

SECTIONS = """==PROF== Disconnected from process 531
  custom_kernel_omlx_qmm_bf16_b4_g64_t1_r1_n2_k4_u2_c4096_o3_whole(const __nv_bfloat16 *, array<int, 10>, int) (384, 1, 1)x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    DRAM Throughput                   %        37.79
    L2 Cache Throughput               %        21.30
    Duration                         us        15.74
    Executed Ipc Active   inst/cycle         2.00
    Executed Instructions                           inst    6,273,792
    Registers Per Thread             register/thread              78
    Achieved Occupancy                        %        33.02
  custom_kernel_omlx_qmm_bf16_b4_g64_t4_r1_n4_k2_u1_c1024_o3(const __nv_bfloat16 *, const int *, float *) (192, 4, 1)x(256, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Duration                         us        38.08
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                   inst         0.89
    smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio          inst         0.10
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio           inst         4.51
"""

SOURCE = """==PROF== Disconnected from process 657
"Address","Source","Warp Stall Sampling (All Samples)","stall_long_sb"
"0x10","LDG.E.128.CONSTANT R20, desc[UR10][R24.64]","2","0"
"0x20","PRMT R31, R25, 0x7632, R27","5","4"
"0x30","BAR.SYNC.DEFER_BLOCKING 0x0","1","0"
"0x40","HMMA.16816.F32.BF16 R24, R28, R36, R24","10","1"
"0x50","BAR.SYNC.DEFER_BLOCKING 0x0","0","0"
"0x60","FADD R18, R23, R18","2","2"
"""


def test_sections_read_each_launch_figures():
    first, second = qmm_profile.sections(SECTIONS)
    assert first["kernel"].endswith("_whole") and first["grid"] == [384, 1] and first["threads"] == 256
    assert (first["duration_us"], first["dram_pct"], first["ipc"]) == (15.74, 37.79, 2.0)
    assert first["l2_pct"] == 21.3 and first["l1_pct"] is None
    assert (first["instructions"], first["registers"], first["achieved_occupancy_pct"]) == (6273792, 78, 33.02)
    assert second["grid"] == [192, 4] and second["duration_us"] == 38.08 and second["registers"] is None


def test_stalls_keep_the_reasons_that_cost_a_fifth_of_a_cycle_or_more():
    second = qmm_profile.stalls(SECTIONS)[1]
    assert second["cycles_per_issue"] == {"barrier": 0.89, "long_scoreboard": 4.51}


def test_parts_split_the_samples_at_the_barriers():
    prologue, main_loop, tail = qmm_profile.parts(SOURCE)
    assert prologue == {"part": "prologue, first weight loads, staging of x", "samples_pct": 40.0,
                        "long_scoreboard_pct": 20.0}
    assert main_loop["part"] == "main loop" and main_loop["samples_pct"] == 50.0
    assert tail["samples_pct"] == 10.0 and tail["long_scoreboard_pct"] == 10.0


def test_config_reads_a_launch_shape_as_config_of_takes_it():
    assert qmm_profile.launch_shape(None) is None and qmm_profile.launch_shape("") is None
    assert qmm_profile.launch_shape("1,4,2,1,1024,3,8") == (1, 4, 2, 1, 1024, 3, 8)
    assert qmm_profile.launch_shape("1, 2,4,2,4096,2") == (1, 2, 4, 2, 4096, 2)
    with pytest.raises(SystemExit, match="--config '1,2,4,2,4096,2,sa': give integers"):
        qmm_profile.launch_shape("1,2,4,2,4096,2,sa")  # the scale-after form's flag: reverted at d6b4f7c
