"""Where a rank runs: the launcher's environment (srun, torchrun, submitit, local; `environment`), Slurm's node-
list grammar (`hostlist`), the one Slurm client (`slurm`), and what Slurm is asked about a job: is it ours
(`slurm_job`), should it come back (`requeue`), when it ends or its nodes drain (`deadline`), when a stopping job
is killed (`kill_time`). No torch. Imports
`mgpu.config` and below.
"""
