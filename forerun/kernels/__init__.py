"""forerun's compiled kernels: the C++ sources (kernels.h, module.cpp, *_rows.cpp), their build key and loader."""
