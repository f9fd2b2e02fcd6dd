"""Snapshots in node memory and their replicas: one rank's snapshots in node-local shared memory that outlive the
process (`store`; `python -m mgpu.state.memory.store --remove-this-job`), a session's snapshots coordinated across
ranks (`snapshots`), what one holds and how it is put back (`content`), when one is due (`cadence`), whether the node
has room for them (`room`), their replicas on a partner of another node (`replica`; the holder's side:
`replica_server`; what both speak: `replica_wire`), the last step a rank completed for a survivor's save
(`step_mark`) and rank 0's buffers at every step's end (`buffer_record`). Imports `mgpu.state.files`,
`mgpu.state.single` (its state-file writer), the modules of `mgpu.state` that a checkpoint holds, and `mgpu.record`
and below.
"""
