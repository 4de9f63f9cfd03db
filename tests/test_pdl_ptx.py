"""The PTX order check of Programmatic Dependent Launch kernels (tests/pdl_ptx.py), on small PTX bodies
shaped as Triton writes them; tests/hopper_compile.py runs it on every PDL variant the backend launches."""

from tests.pdl_ptx import pre_wait_violations

PARAMS = ["q_ptr", "context_lens_ptr", "out_ptr", "stride"]
HEADER = """
.visible .entry kernel(
	.param .u64 .ptr .global .align 16 kernel_param_0,
	.param .u64 .ptr .global .align 16 kernel_param_1,
	.param .u64 .ptr .global .align 16 kernel_param_2,
	.param .u32 kernel_param_3,
	.param .u64 .ptr .global .align 1 kernel_param_4
)
.reqntid 128
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<12>;
	.reg .b64 	%rd<12>;
$L__func_begin0:
	.loc	1 6 0                           // k.py:6:0
	ld.param.b64 	%rd1, [kernel_param_0];
	ld.param.b64 	%rd2, [kernel_param_1];
	ld.param.b64 	%rd3, [kernel_param_2];
	ld.param.b32 	%r9, [kernel_param_3];
	mov.u32 	%r1, %ctaid.x;
	mul.wide.s32 	%rd4, %r1, 4;
	add.s64 	%rd5, %rd2, %rd4;
	// begin inline asm
	mov.u32 %r2, 0x0;
	ld.global.b32 { %r2 }, [ %rd5 + 0 ];
	// end inline asm
	mul.wide.s32 	%rd6, %r2, 2;
	add.s64 	%rd7, %rd1, %rd6;
	// begin inline asm
	{ .reg .pred p; setp.ne.b32 p, %r2, 0; @p prefetch.global.L2 [%rd7]; }
	// end inline asm
"""
WAIT = """
	// begin inline asm
	griddepcontrol.wait; // dummy %r3
	// end inline asm
"""
AFTER = """
	// begin inline asm
	mov.u16 %rs1, 0x0;
	ld.global.L1::evict_last.b16 { %rs1 }, [ %rd7 + 0 ];
	// end inline asm
	add.s64 	%rd8, %rd3, %rd6;
	// begin inline asm
	st.global.b16 [ %rd8 + 0 ], { %rs1 };
	// end inline asm
	ret;
$L__func_end0:
}
	.file	1 "k.py"
"""
Q_LOAD = """
	// begin inline asm
	mov.u16 %rs2, 0x0;
	@%p1 ld.global.b16 { %rs2 }, [ %rd7 + 0 ];
	// end inline asm
"""
TICKET = """
	atom.global.gpu.acq_rel.add.u32 	%r5, [%rd8], 1;
"""
SKIP_WAIT = """
	setp.eq.s32 	%p2, %r2, 0;
	@%p2 bra 	$L__BB0_2;
"""
JOIN = """
$L__BB0_2:
	ret;
"""
MAY_READ = {"context_lens_ptr"}


def test_step_inputs_and_prefetches_before_the_wait_pass():
    assert pre_wait_violations(HEADER + WAIT + AFTER, PARAMS, MAY_READ) == []


def test_a_query_load_before_the_wait_is_reported_with_its_pointer():
    problems = pre_wait_violations(HEADER + Q_LOAD + WAIT + AFTER, PARAMS, MAY_READ)
    assert problems == ["ld.global.b16 of ['q_ptr'] before the wait"]


def test_an_atomic_before_the_wait_is_reported():
    ptx = HEADER + "\tadd.s64 \t%rd8, %rd3, %rd6;" + TICKET + WAIT + AFTER
    assert pre_wait_violations(ptx, PARAMS, MAY_READ) == ["atom.global.gpu.acq_rel.add.u32 before the wait"]


def test_a_branch_around_the_wait_is_reported():
    ptx = HEADER + SKIP_WAIT + WAIT + AFTER.replace("$L__func_end0:", JOIN + "$L__func_end0:")
    assert pre_wait_violations(ptx, PARAMS, MAY_READ) == ["a path from the entry reaches ret without "
                                                          "griddepcontrol.wait"]


def test_a_kernel_without_the_wait_is_reported():
    assert "no griddepcontrol.wait" in pre_wait_violations(HEADER + AFTER, PARAMS, MAY_READ)
