"""Getting ranks up and down: the process group and exit, hostfiles, the multi-node pre-flight,
`toolkit env` and the CUDA arch list DeepSpeed builds ops for."""
