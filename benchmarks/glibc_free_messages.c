/* Which mistakes make glibc print "double free or corruption (out)"?

   Issue 30's crash left one line: glibc's "double free or corruption (out)".
   This program makes each kind of bad free() once, in a forked child, and
   prints the message glibc aborts with, so the message can be read as
   evidence. docs/reliability.md records its output.

   Build and run (any C compiler, glibc):
       cc -pthread -o /tmp/glibc_free_messages benchmarks/glibc_free_messages.c
       /tmp/glibc_free_messages

   In glibc's _int_free, "(out)" is the check that a block of the main arena
   ends inside the main heap. It fires on a pointer that does not come from
   the main heap (another allocator's memory, a mapping, the stack, a thread
   arena's block whose arena bit was overwritten), or on a block whose size
   field was overwritten with a larger one (a write past the end of the block
   before it, or float data written into memory freed and handed out again).
   A plain double free caught at its second free() reads otherwise. */

/* Every case is a mistake on purpose; the compiler sees most of them. */
#pragma GCC diagnostic ignored "-Wpragmas"
#pragma GCC diagnostic ignored "-Wuse-after-free"
#pragma GCC diagnostic ignored "-Wfree-nonheap-object"
#pragma GCC diagnostic ignored "-Wstringop-overflow"

#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

/* The size field sits in the word before the pointer; bit 0 is PREV_INUSE,
   bit 1 IS_MMAPPED, bit 2 NON_MAIN_ARENA. */
static size_t *size_field(void *p) { return (size_t *)p - 1; }

static void double_free_small(void) {
    void *p = malloc(64);
    free(p);
    free(p);
}

static void double_free_between_live_blocks(void) {
    void *a = malloc(4000), *b = malloc(4000), *c = malloc(4000);
    (void)a, (void)c;
    free(b);
    free(b);
}

static void double_free_next_to_top(void) {
    void *a = malloc(4000), *b = malloc(4000);
    (void)a;
    free(b);
    free(b);
}

static void double_free_after_reuse(void) {
    void *a = malloc(4000), *b = malloc(100000);
    (void)a;
    free(b);
    void *c = malloc(20000); /* takes b's memory again */
    (void)c;
    free(b);
}

static void *thread_malloc(void *unused) {
    (void)unused;
    return malloc(4000);
}

static void *thread_arena_block(void) {
    pthread_t thread;
    void *p;
    pthread_create(&thread, NULL, thread_malloc, NULL);
    pthread_join(thread, &p);
    return p;
}

static void double_free_thread_arena(void) {
    void *p = thread_arena_block();
    free(p);
    free(p);
}

static void interior_pointer(void) {
    char *a = malloc(4000);
    void *guard = malloc(100);
    (void)guard;
    free(a + 1024);
}

static void mapped_memory(void) {
    char *m = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    *size_field(m + 4096) = 2048 | 1;
    free(m + 4096);
}

static void stack_memory(void) {
    size_t words[1024];
    memset(words, 0, sizeof words);
    *size_field(&words[512]) = 2048 | 1;
    free(&words[512]);
}

static void overrun_into_next_header(void) {
    char *a = malloc(4000), *b = malloc(4000);
    void *guard = malloc(100);
    (void)guard;
    memset(a, 0x41, 4000 + 16); /* 16 bytes past a's end: b's size field */
    free(b);
}

static void size_field_enlarged(void) {
    char *a = malloc(4000), *b = malloc(4000);
    void *guard = malloc(100);
    (void)a, (void)guard;
    *size_field(b) = (1 << 20) | 1;
    free(b);
}

/* A receive that lands after its buffer was freed and handed out again: the
   float32 values (gradients near 1) overwrite a newer block's size field. */
static void late_float_write_into_reused_memory(void) {
    float *received = malloc(4000 * sizeof(float));
    void *guard = malloc(100);
    (void)guard;
    free(received);
    char *first = malloc(1000), *second = malloc(1000);
    (void)first;
    for (int i = 0; i < 4000; i++) received[i] = 1.0f;
    free(second);
}

static void thread_block_arena_bit_cleared(void) {
    void *p = thread_arena_block();
    *size_field(p) &= ~(size_t)4;
    free(p);
}

static const struct {
    const char *what;
    void (*run)(void);
} cases[] = {
    {"double free, 64 B block", double_free_small},
    {"double free, 4000 B block between live blocks", double_free_between_live_blocks},
    {"double free, 4000 B block next to the heap's top", double_free_next_to_top},
    {"double free, 100 kB block handed out again in between", double_free_after_reuse},
    {"double free, 4000 B block of a thread arena", double_free_thread_arena},
    {"free of an interior pointer (+1024 B)", interior_pointer},
    {"free of mmap()ed memory, a plausible size field", mapped_memory},
    {"free of stack memory, a plausible size field", stack_memory},
    {"16 B written past a block, free of the next block", overrun_into_next_header},
    {"a block's size field enlarged to 1 MiB, then freed", size_field_enlarged},
    {"float32 1.0s written into a freed block handed out again", late_float_write_into_reused_memory},
    {"a thread arena's block, arena bit cleared, freed", thread_block_arena_bit_cleared},
};

int main(void) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int pipe_fds[2];
        if (pipe(pipe_fds) != 0) return 1;
        pid_t pid = fork();
        if (pid == 0) {
            dup2(pipe_fds[1], 2);
            cases[i].run();
            _exit(0);
        }
        close(pipe_fds[1]);
        char message[512] = {0};
        ssize_t n = read(pipe_fds[0], message, sizeof message - 1);
        (void)n;
        close(pipe_fds[0]);
        int status;
        waitpid(pid, &status, 0);
        message[strcspn(message, "\n")] = 0;
        const char *seen = !WIFSIGNALED(status) ? "no error (exit 0)"
                           : message[0]        ? message
                                               : "a signal, no message";
        printf("%-56s -> %s\n", cases[i].what, seen);
    }
    return 0;
}
