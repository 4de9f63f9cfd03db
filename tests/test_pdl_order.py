"""PDL's ordering rules (attention/pdl.py) hold in the model kernels' PTX for sm_90: before
griddepcontrol.wait they only read weights (tests/ptx_order.py reads the PTX; tests/hopper_compile.py
compiles the variants the model launches)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ptx_order import pdl_order_violations

POINTERS = {0: "x_ptr", 1: "w_ptr", 2: "y_ptr"}
HEAD = """
.visible .entry k(.param .u64 k_param_0, .param .u64 k_param_1, .param .u64 k_param_2, .param .u32 k_param_3)
{
	ld.param.u64 	%rd1, [k_param_0];
	ld.param.u64 	%rd2, [k_param_1];
	ld.param.u64 	%rd3, [k_param_2];
	ld.param.u32 	%r1, [k_param_3];
	mul.wide.s32 	%rd4, %r1, 2;
	add.s64 	%rd5, %rd2, %rd4;
	add.s64 	%rd6, %rd1, %rd4;
"""
TAIL = """
	// begin inline asm
	griddepcontrol.wait; // dummy %r9
	// end inline asm
	griddepcontrol.launch_dependents;
	ld.global.b32 	%r7, [%rd6];
	st.global.b32 	[%rd3], %r7;
}
"""


def test_the_ptx_check_allows_weight_reads_and_flags_activation_reads_and_writes_before_the_wait():
    weight_prefetch = ("\tprefetch.global.L2 [%rd5]; mov.u32 %r2, 0;\n"
                       "\t@%p1 ld.global.v2.b32 {%r3, %r4}, [%rd5+8];\n")
    assert pdl_order_violations(HEAD + weight_prefetch + TAIL, POINTERS, {"w_ptr"}) == []
    activation = "\tld.global.b32 \t%r5, [%rd6];\n"
    assert "x_ptr" in pdl_order_violations(HEAD + activation + TAIL, POINTERS, {"w_ptr"})[0]
    through_a_loaded_index = "\tld.global.b32 %r5, [%rd6];\n\tmul.wide.s32 %rd7, %r5, 2;\n" \
                             "\tadd.s64 %rd8, %rd2, %rd7;\n\tld.global.b32 %r6, [%rd8];\n"
    assert len(pdl_order_violations(HEAD + through_a_loaded_index + TAIL, POINTERS, {"w_ptr"})) == 2
    store = "\tst.global.b32 \t[%rd5], %r1;\n"
    assert "write" in pdl_order_violations(HEAD + store + TAIL, POINTERS, {"w_ptr"})[0]
    assert pdl_order_violations(HEAD + TAIL.replace("griddepcontrol.wait", "nop"), POINTERS, {"w_ptr"}) == \
        ["no griddepcontrol.wait"]


def test_the_model_kernels_read_only_weights_before_the_pdl_wait():
    """Compiled for sm_90 in a process without TRITON_INTERPRET (no GPU needed): the skinny GEMM, its epilogue
    variants and the fused elementwise kernels, PDL on."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-m", "tests.hopper_compile", "--pdl-only"], env=env,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent,
                            timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
