//! Tokenizer, chat template, incremental detokenization and stop strings: the text side of a request, shared by the router and `tandem generate`.
