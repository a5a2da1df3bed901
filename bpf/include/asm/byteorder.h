/* Arch-neutral shim: topolb compiles for -target bpfel only. */
#include <linux/byteorder/little_endian.h>
