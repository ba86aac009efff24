"""Moving bytes between engines' caches and the region, off the loop.

Rules:
- The loop validates every transfer before any address reaches this package
  (``kvoffloadd.service.transfers``); copier threads, descriptor copies and GPU lanes
  only execute runs and report completions through one ``CompletionSink``.
- No thread here touches daemon metadata; memory behind a job's addresses stays
  mapped until its completion is drained on the loop.
- Engine memory the daemon cannot seal is only touched by the kernel (``fdcopy``).
- CUDA is reached through the driver API only (``kvoffload.cuda.driver``), no toolkit;
  the one kernel (``gather.cu``) ships as PTX that the driver compiles at load.
"""
