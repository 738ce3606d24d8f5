"""nn.Modules: the DFlash block drafter (and, later, the AR approximation layer and the Weaver adapter)."""
