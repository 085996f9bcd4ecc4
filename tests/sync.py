"""A block in which any host sync raises (CUDA tests of the sync-free paths)."""

import torch


class sync_errors:
    """``torch.cuda.set_sync_debug_mode("error")`` for a block: any host sync raises."""

    def __enter__(self):
        self.old = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.old)
