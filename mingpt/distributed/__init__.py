"""The torchrun job: joining and leaving its process group (process_group), stopping every rank after the same
step (stopping), never outliving the torchrun agent (orphans), and the opt-in fork server (forkserver)."""
