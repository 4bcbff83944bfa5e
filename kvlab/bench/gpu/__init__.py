"""The GPU run book: ``python -m kvlab.bench gpu --out DIR [--dry-run]``.

Everything a lent GPU should run, in order, each stage in its own process with its own time box (a hung
kernel or a CUDA error ends that stage only), into one flat folder of at most 8 files (what the device
machine hands back):

  env      what is there: versions, the GPU, compute-sanitizer, the optional peers (stage_env.py)
  tests    the kernel and engine test suites compiled, GPU-only sizes against the torch twins, a race check,
           compute-sanitizer memcheck on one small launch of each kernel (stage_tests.py, kernel_checks.py)
  kernels  every kernel beside torch SDPA and FlexAttention on the same paged K/V (stage_kernels.py)
  engine   kvlab.engine on nano-vllm's workload beside Hugging Face's engines (stage_engine.py)
  plots    the figures of notebooks 05, 06 and 09 from the CSVs in DIR (stage_plots.py)

``--dry-run`` runs the same code on CPU at tiny sizes (kernels in the Triton interpreter), so CI runs the
run book itself. driver.py starts the stages; stage.py is what each stage's process runs.
"""
