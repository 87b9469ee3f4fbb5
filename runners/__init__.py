"""Run-time package (`kvforge.runners`): load a compiled artifact and generate text. Imports
without torch. Internal: the public names (`Engine`, `SamplingParams`, ...) are `kvforge`'s,
which loads each on first use, so that importing one small module of this package
(`kvforge.runners.errors`, say, as the command line does before it has work to do) does not
load the engine, numpy and the tokenizer with it.
"""
