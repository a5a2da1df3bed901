/* Arch-neutral shim: the BPF target has no asm/ directory of its own, and
 * Debian's clang does not search /usr/include/<triplet>. Keeping the shim
 * in-tree makes `make generate` identical on every build host. */
#include <asm-generic/posix_types.h>
