"""Device repro: dcp.async_save of an FSDP2 model + AdamW on CUDA with DefaultStager variants, 5 saves each."""
import os, sys, tempfile, traceback
import torch, torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.fsdp import fully_shard

os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
group = dist.new_group(backend="gloo")
torch.cuda.set_device(0)
for pinned, nonblock in [(True, True), (True, False), (False, False)]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)).cuda()
    for m in model:
        if any(True for _ in m.parameters()): fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stager = DefaultStager(StagingOptions(use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=nonblock))
    results = []
    for save in range(5):
        for _ in range(3):
            loss = model(torch.randn(8, 64, device="cuda")).square().mean(); loss.backward(); opt.step(); opt.zero_grad()
        msd, osd = get_state_dict(model, [opt])
        try:
            r = dcp.async_save({"model": msd, "optim": osd}, storage_writer=FileSystemWriter(tempfile.mkdtemp(), sync_files=True),
                               process_group=group, async_stager=stager)
            st = getattr(r, "staging_completion", None)
            if st is not None: st.result()
            getattr(r, "upload_completion", r).result()
            results.append("ok")
        except BaseException as e:
            results.append(f"{type(e).__name__}: {e}"[:100])
            if results.count(results[-1]) == 1:
                traceback.print_exc(limit=-12)
    print(f"pinned={pinned} non_blocking={nonblock}: {results}", flush=True)
    stager.close()
dist.destroy_process_group()
