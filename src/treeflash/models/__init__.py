"""nn.Modules of the drafters: the DFlash block drafter, DFlash2, TreeFlash's AR approximation layer, the Weaver;
their checkpoints and exports. (The target's own forwards live in `runtime/`.)"""
