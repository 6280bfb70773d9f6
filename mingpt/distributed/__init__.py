"""The torchrun job: joining and leaving its process group (process_group), stopping every rank after the same
step (stopping), and never outliving the torchrun agent (orphans)."""
